"""``exclude_collectives``: checked where it is given, and free where no collective can run.

The behaviour with collectives is tested on gloo ranks (tests/distributed/
test_collective_cache.py, test_sequence_parallel.py); here, in one process
without a process group, the option must cost nothing: no dispatch mode is
entered, in the forward or the replay.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack  # noqa: E402

import recomp.torch as rt  # noqa: E402


@pytest.mark.parametrize("bad", [None, 1, "yes"])
def test_a_non_bool_is_rejected_where_it_is_given(bad):
    with pytest.raises(ValueError, match="exclude_collectives must be True or False"):
        rt.checkpoint(torch.sin, torch.randn(2, requires_grad=True), exclude_collectives=bad)
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="exclude_collectives must be True or False"):
        rt.checkpoint_wrapper(layer, exclude_collectives=bad)
    assert type(layer) is nn.Linear
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="exclude_collectives must be True or False"):
        rt.apply_activation_checkpointing(
            model, checkpoint_fn=nn.Linear, exclude_collectives=bad
        )
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize("keep", [True, False])
def test_without_a_process_group_no_mode_is_entered(keep):
    assert not torch.distributed.is_initialized()
    modes = []

    def body(x):
        modes.append(len(_get_current_dispatch_mode_stack()))
        return torch.sin(x) * x

    x = torch.randn(3, requires_grad=True)
    rt.checkpoint(body, x, exclude_collectives=keep).sum().backward()
    assert modes == [0, 0]  # forward, replay
    assert torch.equal(x.grad, torch.cos(x) * x + torch.sin(x))
