"""The `clusterfit` command (and `python -m clusterfit`): the CLI, its imports made with the garbage collector off."""

from clusterfit.processes import long_lived_imports


def main() -> None:
    # The CLI's imports (typer, rich, pydantic and the spec's models), frozen afterwards: the collections of the
    # commands that run long (a server, a job's supervisor) skip them.
    with long_lived_imports():
        from clusterfit.cli import main as run_command

    run_command()


if __name__ == "__main__":
    main()
