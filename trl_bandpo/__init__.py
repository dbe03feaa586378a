"""BandPO and DGPO for HuggingFace TRL."""

__version__ = "0.1.0"
