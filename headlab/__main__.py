"""`python -m headlab` runs the same CLI as the `headlab` command."""

from headlab.cli import main

if __name__ == "__main__":
    main()
