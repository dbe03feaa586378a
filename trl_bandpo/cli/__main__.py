"""`python -m trl_bandpo.cli` = the `trl-bandpo` command."""

from . import main

main()
