"""``Loader.load_state_dict`` checks every state through one ``resume_point`` call, whether the
state was taken at an epoch's end or inside it. These pin where each kind of state puts the
stream, and that a state at an epoch's end is still checked against the loader (batch size, seed,
reader), so that folding the two calls into one changed nothing.
"""

from __future__ import annotations

import pytest

from headrace import ConfigError, Loader, readers

SAMPLES, BATCH = 10, 4  # three batches an epoch: 4, 4, 2


def _loader(**kw) -> Loader:
    items = [{"__key__": f"k{i}", "cls": i} for i in range(SAMPLES)]
    kw.setdefault("batch_size", BATCH)
    return Loader(readers.sequence(items, shuffle=False), device="cpu", **kw)


def _state(loader: Loader, *, epoch: int, position: int, batches: int, epoch_end: bool) -> dict:
    return {**loader.state_dict(), "epoch": epoch, "position": position, "batches": batches,
            "epoch_end": epoch_end}


def _where(loader: Loader) -> tuple[int, int, int]:
    state = loader.state_dict()
    return state["epoch"], state["position"], state["batches"]


def test_a_state_inside_an_epoch_resumes_there():
    loader = _loader()
    loader.load_state_dict(_state(_loader(), epoch=2, position=4, batches=1, epoch_end=False))
    assert _where(loader) == (2, 4, 1)


def test_a_state_at_an_epochs_end_resumes_at_the_next_epochs_start():
    loader = _loader()
    loader.load_state_dict(_state(_loader(), epoch=2, position=7, batches=2, epoch_end=True))
    assert _where(loader) == (3, 0, 0)


def test_a_state_after_the_last_batch_without_epoch_end_resumes_at_the_next_epoch():
    loader = _loader()
    loader.load_state_dict(_state(_loader(), epoch=2, position=SAMPLES, batches=3, epoch_end=False))
    assert _where(loader) == (3, 0, 0)


@pytest.mark.parametrize("epoch_end", [False, True])
@pytest.mark.parametrize("other", [{"batch_size": BATCH + 1}, {"seed": 7}])
def test_a_state_from_another_loader_is_refused_wherever_it_was_taken(epoch_end, other):
    state = _state(_loader(), epoch=1, position=4, batches=1, epoch_end=epoch_end)
    with pytest.raises(ConfigError, match="state was saved with"):
        _loader(**other).load_state_dict(state)
