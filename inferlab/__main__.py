"""`python -m inferlab`: the same Hydra app as the `inferlab` command (see inferlab/cli.py)."""

from inferlab.cli import main

if __name__ == "__main__":
    main()
