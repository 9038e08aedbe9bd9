"""A publisher in its own process for the crash test: publishes an anchor, then versions until killed.

    python tests/publisher_child.py <store-url> <run> <key.pem> <seed>

numpy only (no torch import) so that it starts fast and the parent can kill it at any point of a publish.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.publish.publisher import Publisher  # noqa: E402
from worker_contract.manifest import load_manifest  # noqa: E402
from worker_contract.signing import load_private_key  # noqa: E402
from worker_contract.store import open_store  # noqa: E402


def main() -> None:
    url, run, key_path, seed = sys.argv[1:5]
    store = open_store(url)
    manifest = load_manifest(store, run)
    pub = Publisher(store, manifest, load_private_key(key_path), anchor_interval=manifest.anchor_interval,
                    progress=False, shard_bytes=1 << 20)
    rng = np.random.default_rng(int(seed))
    w = {f"model.layers.{i}.mlp.weight": rng.normal(0, 0.02, (512, 512)).astype(np.float32) for i in range(6)}
    w["model.norm.weight"] = np.ones(512, np.float32)
    print("ready", flush=True)  # imports done: the parent's clock for the kill starts here
    v = pub.publish_anchor(w).version
    print(f"published {v}", flush=True)
    while True:
        for t in w.values():
            t += np.sign(rng.standard_normal(t.shape)).astype(np.float32) * 4e-6
        v = pub.publish(w).version
        print(f"published {v}", flush=True)


if __name__ == "__main__":
    main()
