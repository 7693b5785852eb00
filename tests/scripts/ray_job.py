"""Submit a job to Ray, or ask for its status or cancel it, each from its own process, as a job service would:
`ray_job.py submit JOB.yaml` prints the engine reference as JSON; `status REF` / `cancel REF` take it back."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from clusterfit.backends import EngineRef, get_backend
from clusterfit.spec import load_spec


def main(action: str, argument: str) -> None:
    backend = get_backend("ray")
    if action == "submit":
        handle = backend.submit(load_spec(argument))
        print(json.dumps(asdict(handle.ref)))
        return
    ref = EngineRef(**json.loads(argument))
    if action == "status":
        print(json.dumps(asdict(backend.status(ref))))
    elif action == "cancel":
        backend.cancel(ref)
        print("cancelled")


if __name__ == "__main__":
    main(*sys.argv[1:])
