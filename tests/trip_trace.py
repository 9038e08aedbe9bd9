"""Entry point tests/test_trip.py runs in a fresh process: one step of the native engine, traced.

    python tests/trip_trace.py <tmp_dir>
        prints one JSON object: each file of ours whose functions ran while a batch went from the bucket
        to a published patch, with their names

The learner's two actor classes (trainer/native/learner.py) run here as plain objects, with their own
methods; only the Ray hop between them is left out. Setup (resume, the first anchor) is not traced, and
neither is code that runs only when a module is imported.
"""

from __future__ import annotations

import inspect
import json
import random
import sys
import threading
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(ROOT))


def main(tmp: Path) -> dict[str, list[str]]:
    import learner_fixtures as lf

    from trainer.native.learner import LearnerActor, SourceActor
    from trainer.ray_runtime import key_to_pem, store_spec
    from worker_contract.manifest import create_or_resume
    from worker_contract.signing import generate_private_key
    from worker_contract.store.file import FileStore

    store, key, cfg = FileStore(tmp / "bucket"), generate_private_key(), lf.recipe()
    man = create_or_resume(store, lf.manifest("trip", key), resume=False)
    model_dir = lf.save_tiny_model(tmp / "model")
    seen: dict[str, set[str]] = defaultdict(set)
    tracing = threading.Event()

    def profile(frame, event, _arg):
        code = frame.f_code
        # functions only: a module's or class's body (CO_NEWLOCALS unset) and module-level comprehensions
        # run when a module is first imported, which is not the trip
        if (event == "call" and tracing.is_set() and code.co_flags & inspect.CO_NEWLOCALS
                and not code.co_qualname.startswith("<") and code.co_filename.startswith(str(ROOT))
                and not code.co_filename.startswith(str(TESTS))
                and "site-packages" not in code.co_filename):  # a venv inside the checkout (CI's .venv, .nox)
            seen[Path(code.co_filename).relative_to(ROOT).as_posix()].add(code.co_qualname)

    threading.setprofile(profile)  # before the publisher and poller threads start
    sys.setprofile(profile)
    spec, mjson = store_spec(store), man.model_dump_json()
    source = SourceActor(spec, mjson, cfg.algo.model_dump_json(), cfg.train.poll_interval_s, str(model_dir))
    learner = LearnerActor(cfg.model_dump_json(), str(model_dir), str(tmp / "run"), None, spec, mjson,
                           key_to_pem(key), torch_threads=1)
    session = learner.session
    session.resume(learner.backend)
    session.publish_start(learner.backend.publish_snapshot(), source.counts())
    rng = random.Random(0)
    for g in range(cfg.algo.groups_per_step):
        lf.put_record(store, lf.make_record("trip", 1, f"w{g}", f"g{g}", rng))
    tracing.set()
    session.take_published()  # LearnerActor.train_one without its Ray hop
    got = source.next_batch(session.current, 60.0)
    assert got is not None, "no batch within 60 s"
    learner.train_batch(*got)
    session.close()  # the publisher thread's work: the patch and the pointer
    tracing.clear()
    source.stop()
    assert session.current == 2, session.current
    return {f: sorted(names) for f, names in sorted(seen.items())}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
