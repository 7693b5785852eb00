"""The `clusterfit` command (and `python -m clusterfit`): the CLI, its imports made with the garbage collector off."""

import gc


def main() -> None:
    # NOTE: while the CLI's imports (typer, rich, pydantic and the spec's models) make their objects, each
    # collection walks every object made so far. Frozen afterwards, they are skipped by the collections of
    # the commands that run long (a server, a job's supervisor).
    gc.disable()
    from clusterfit.cli import main as run_command

    gc.freeze()
    gc.enable()
    run_command()


if __name__ == "__main__":
    main()
