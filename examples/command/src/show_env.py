"""Prints what a command job's process sees: its rank and the variables of its distribution.type."""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--greeting", default="hi")
args = parser.parse_args()
shown = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FOO"]
shown += sorted(name for name in os.environ if name.startswith(("OMPI_COMM_WORLD_", "PMI_")))
shown += ["TF_CONFIG"] if "TF_CONFIG" in os.environ else []
print(args.greeting, " ".join(f"{name}={os.environ.get(name)}" for name in shown), flush=True)
