"""How well the pilot's index predicts a live engine's prefix cache under eviction.

For each engine path (vLLM + ZMQ subscriber, SGLang + our plugin, SGLang + ZMQ) and each
scenario (a fresh application; the application restarted against a running engine; two
event batches lost), 30 requests of 4-6 documents from a pool of 12 overflow a 2k-token
KV pool; after each, the pilot's predicted cached tokens are compared with the engine's
``cached_tokens`` (agreement: within one page). ``before`` runs the code as it was before
issue 24 (no block ends, no confirmation of unseen pages); ``after`` the current code.
Needs the live engines: ``scripts/setup_live_engine.sh vllm`` / ``sglang``.

    python benchmarks/bench_live_engines.py [--paths vllm-zmq sglang-plugin sglang-zmq]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from contextpilot_integrations.testing.live_engines import (
    PATHS,
    EventPath,
    agreement,
    require_live_engine,
    run_scenario,
)

SCENARIOS = ("normal", "app-restarted", "batches-dropped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--modes", nargs="+", choices=("before", "after"), default=["before", "after"])
    args = parser.parse_args()

    def unavailable(reason: str) -> None:
        raise SystemExit(reason)

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.paths:
            where = require_live_engine(name.split("-")[0], unavailable)
            t0 = time.monotonic()
            path = EventPath(name, where, Path(tmp))
            print(f"{name}: engine up in {time.monotonic() - t0:.0f} s (page {path.page_size})", flush=True)
            try:
                for scenario in args.scenarios:
                    for mode in args.modes:
                        t0 = time.monotonic()
                        outcomes = run_scenario(path, scenario, fixed=mode == "after")
                        late = agreement(outcomes[3:])
                        print(
                            f"  {scenario:16} {mode:6} all: {agreement(outcomes)}; after the first 3: "
                            f"{late.agree}/{late.requests}, {late.over} over  [{time.monotonic() - t0:.0f} s]",
                            flush=True,
                        )
            finally:
                path.stop()


if __name__ == "__main__":
    main()
