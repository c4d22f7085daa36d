"""ResumableDistributedSampler under DDP (2 real processes, gloo): killed, resumed on 2 ranks and on 1.

Each rank draws its batches from a DataLoader through the sampler (40 samples, shuffled per epoch by
``set_epoch``, 2 a batch per rank: 10 iterations an epoch), the sampler a ``data=`` object of the
Checkpointer (tests/support/mr_cases.py, ``sampler``). On 2 ranks, every rank SIGKILLed in iteration 7
and restarted: every loss and the final state (the sampler's position in it) equal the uninterrupted
run's, bit for bit, across the epoch boundary. Then a 2-rank run killed inside the second epoch
resumes on 1 rank: the rest of that epoch is exactly the samples the 2 ranks had not trained, each once,
and the epoch after it is whole.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.support.mr_harness import Case, assert_same_state, run_cases

pytestmark = pytest.mark.slow

ITERATIONS = 16  # 10 an epoch on 2 ranks
SAMPLES = 40


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sampler")
    base = {"kind": "ddp", "sampler": True}
    ck, cut = str(root / "ck"), str(root / "cut")
    run_cases([{**base, "name": "ref", "mode": "ref", "iterations": ITERATIONS},
               {**base, "name": "kill", "mode": "attach", "iterations": ITERATIONS, "dir": ck,
                "kill": {"rank": None, "at": "forward:7"}},
               {**base, "name": "resume", "mode": "attach", "iterations": ITERATIONS, "dir": ck},
               {**base, "name": "cut", "mode": "attach", "iterations": ITERATIONS, "dir": cut,
                "kill": {"rank": None, "at": "forward:14"}}], 2, root / "out")
    run_cases([{**base, "name": "one", "mode": "attach", "iterations": 50, "dir": cut}], 1, root / "out")
    return root / "out"


def batches(case: Case, rank: int) -> dict[int, tuple[int, list[int]]]:
    return {e["it"]: (e["epoch"], e["ids"]) for e in case.events(rank, "batch")}


def test_killed_and_resumed_on_two_ranks_is_bit_exact(out: Path) -> None:
    ref, kill, resume = Case(out, "ref", 2), Case(out, "kill", 2), Case(out, "resume", 2)
    for r in range(2):
        assert kill.rc(r) != 0  # SIGKILLed in iteration 7
        assert ref.rc(r) == 0 and resume.rc(r) == 0, resume.log(r)
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] is not None and 0 < resumed["step"] <= 7
        want = dict(ref.losses(r))
        for it, loss in resume.losses(r):
            assert loss == want[it], f"rank {r} iteration {it}"
        assert {it for it, _ in resume.losses(r)} == set(range(resumed["step"], ITERATIONS))
        ref_batches = batches(ref, r)
        assert all(ref_batches[it] == got for it, got in batches(resume, r).items())
        assert_same_state(ref.final(r), resume.final(r))  # weights, optimizer, RNG, the sampler's position
    epochs = Counter(epoch for r in range(2) for epoch, _ in batches(ref, r).values())
    assert epochs == {0: 20, 1: 12}  # the resumed run crossed the epoch boundary


def test_resumed_on_one_rank_trains_the_rest_of_the_epoch_once(out: Path) -> None:
    cut, one = Case(out, "cut", 2), Case(out, "one", 1)
    assert one.rc(0) == 0, one.log(0)
    [resumed] = one.events(0, "resumed")
    step = resumed["step"]
    assert step is not None and 10 < step <= 14  # inside the second epoch
    before = [i for r in range(2) for it, (epoch, ids) in batches(cut, r).items() if it < step and epoch == 1
              for i in ids]
    after = {it: (epoch, ids) for it, (epoch, ids) in batches(one, 0).items()}
    assert min(after) == step
    rest = [i for epoch, ids in after.values() if epoch == 1 for i in ids]
    assert len(before) == 2 * 2 * (step - 10)
    assert Counter(before + rest) == Counter(range(SAMPLES))  # every sample of the epoch once, none again
    assert [it for it, (epoch, _) in after.items() if epoch == 1] == list(range(step, step + len(rest) // 2))
    whole = [i for epoch, ids in after.values() if epoch == 2 for i in ids]
    assert sorted(whole) == list(range(SAMPLES))  # the next epoch is whole, on one rank (20 iterations)
