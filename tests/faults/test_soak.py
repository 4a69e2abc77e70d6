"""Soak: 1,000 refits in a row with the trainer mutating its buffers right after each drain, and
no torn read: every received tensor is exactly the leased version's stamp (every byte of every
tensor depends on the version, so bytes of the next version, or a mix, never pass).

One trainer process and one reader process live across all cycles and loop inside themselves:
the trainer publishes version v (stamping its buffers in place), waits until the reader
completed its read (``expected_readers=1``, ``wait_read``: retire, drain), and at once stamps
v + 1 into the same buffers and publishes it; the reader refits v, checks every tensor against
the stamps of v - 1, v and v + 1, and asks for v + 1.
"""

from __future__ import annotations

import pytest
from _harness import failover_worker

pytestmark = pytest.mark.timeout(900)
MODEL = "soak"
CYCLES = 1000


@pytest.mark.slow
def test_1000_refits_with_the_trainer_mutating_after_each_drain_tear_nothing(catalog_proc, log_dir) -> None:
    trainer = failover_worker("soak-trainer", catalog_proc.address, MODEL, log_dir, "soak-trainer",
                              "--ranks", "1", "--elems", str(1 << 11), "--ttl", "10")
    reader = failover_worker("soak-reader", catalog_proc.address, MODEL, log_dir, "soak-reader",
                             "--lease-ttl", "5", "--transfer-timeout", "10")
    try:
        trainer.send(cmd="run", first=1, cycles=CYCLES)
        reader.send(cmd="run", first=1, cycles=CYCLES)
        read = reader.next(timeout=800)
        trained = trainer.next(timeout=60)
    finally:
        reader.kill()
        trainer.kill()
    assert read.get("done") and trained.get("done"), (read, trained)
    print(f"soak: {read['refits']} refits, {read['tensors_checked']} tensors checked, "
          f"{read['torn_count']} torn, reader loop {read['seconds']:.1f} s, trainer loop {trained['seconds']:.1f} s")
    assert read["refits"] == CYCLES
    assert read["tensors_checked"] == CYCLES * 4  # 3 replicated tensors and the rank's own
    assert read["torn_count"] == 0, read["torn"]
