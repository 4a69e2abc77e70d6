"""A throwaway publisher process (vLLM venv): publishes one checkpoint's HF tensors, whole, as a
version, reports READY and then waits to be killed (the "source dies mid-pull" case).

Usage: ``_hf_source.py CATALOG MODEL VERSION HF_DIR``; prints ``ready`` once the version is READY.
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    from mx_refit import PublishedTensor, Publisher
    from mx_refit.testing.checkpoints import load_version

    catalog, model, version, hf_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    tensors = load_version(hf_dir)
    # One source id per process: two live processes sharing an id would be one rank restarted,
    # and the newer incarnation would expire the older one's versions.
    publisher = Publisher(catalog, model, source_id=f"{model}/hf-source-v{version}", ttl_s=60.0)
    publisher.publish(version, [PublishedTensor(name, tensor) for name, tensor in tensors.items()])
    print("ready", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
