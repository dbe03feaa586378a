"""The trainers and their configs on TRL: `PolicyLossTrainer` (GRPOTrainer), the asynchronous trainers
(AsyncGRPOTrainer), and what they add to TRL's loop (docs/architecture.md)."""
