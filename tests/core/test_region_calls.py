"""One excluded-region call as an object: what its observers see, the bytes it reports,
and recomp's own invariant checks."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import recomp
import recomp.torch as rt
from recomp._hooks import RegionObserver, observing


class EventLog(RegionObserver):
    def __init__(self):
        self.events = []

    def region_started(self, call):
        self.events.append(("started", call.region_name))

    def region_finished(self, call, ok):
        self.events.append(("finished", call.region_name, ok))

    def region_skipped(self, call):
        self.events.append(("skipped", call.region_name))

    def tensor_kept(self, call, original, kept):
        self.events.append(("kept", call.region_name, tuple(original.shape)))

    def tensor_deferred(self, call, original, is_view):
        self.events.append(("deferred", call.region_name, is_view))

    def output_cached(self, call, output, nbytes):
        self.events.append(("cached", call.region_name, nbytes))

    def boundary_applied(self, call, saved, outputs):
        self.events.append(("boundary", call.region_name, len(saved), len(outputs)))


def block():
    torch.manual_seed(0)
    lin, act = nn.Linear(8, 8), nn.Tanh()
    region = rt.checkpoint_exclude_wrapper(nn.Sequential(lin, act), name="proj")

    def fn(x):
        return region(x * 2).sin()

    return region, fn


def test_an_observer_sees_one_call_from_start_to_skip():
    region, fn = block()
    x = torch.randn(4, 8, requires_grad=True)
    log = EventLog()
    with observing(log):
        out = rt.checkpoint(fn, x)
        forward = list(log.events)
        out.sum().backward()
    assert forward == [
        ("started", "proj"),
        ("deferred", "proj", False),  # linear's input x * 2: the replay rebuilds it
        ("kept", "proj", (4, 8)),  # tanh's output, saved by tanh
        ("finished", "proj", True),
        ("cached", "proj", 0),  # the output is tanh's saved output: no extra bytes
        ("boundary", "proj", 1, 1),
    ]
    assert log.events[len(forward) :] == [("skipped", "proj")]
    assert region.region_runs == 1 and region.region_skips == 1


def test_a_failing_region_is_reported_finished_not_ok():
    def boom(t):
        raise ValueError("boom")

    region = rt.checkpoint_exclude_wrapper(boom, name="boom")
    log = EventLog()
    with observing(log), pytest.raises(ValueError, match="boom"):
        rt.checkpoint(lambda t: region(t * 2), torch.randn(2, requires_grad=True))
    assert log.events == [("started", "boom"), ("finished", "boom", False)]


def test_observers_belong_to_the_context_that_installed_them():
    region, fn = block()
    log = EventLog()
    seen_elsewhere = []

    def other_thread():
        rt.checkpoint(fn, torch.randn(4, 8, requires_grad=True)).sum().backward()
        seen_elsewhere.append(region.region_runs)

    with observing(log):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(timeout=60)
    assert seen_elsewhere == [1]  # the other thread's call ran ...
    assert log.events == []  # ... unseen by this thread's observer


def test_saved_bytes_of_a_region_called_twice_after_the_last_saved_tensor():
    """Both calls lose their cached outputs at the end of the forward (early stop):
    what the region then holds is its last call's saved input, which is the first
    call's output (the linear's input, kept because it is an excluded output)."""
    lin = nn.Linear(8, 8)
    region = rt.checkpoint_exclude_wrapper(lin, name="lin")
    x = torch.randn(4, 8, requires_grad=True)
    out = rt.checkpoint(lambda t: region(region(t * 2)), x)
    assert region.region_saved_bytes == 4 * 8 * 4
    out.sum().backward()
    assert x.grad is not None


def test_internal_assert_survives_python_O_and_names_a_recomp_bug():
    code = (
        "from recomp.errors import internal_assert, RecompInternalError\n"
        "try:\n"
        "    internal_assert(1 == 2, 'one is not two')\n"
        "except RecompInternalError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "one is not two" in proc.stdout
    assert "bug in recomp" in proc.stdout


class Branchy(nn.Module):
    """Calls its excluded projection on the first call only: the replay takes the other
    branch, which saves as many tensors of the same shapes, so only recomp can notice."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.proj = rt.checkpoint_exclude_wrapper(nn.Linear(8, 8), name="proj")

    def forward(self, x):
        self.calls += 1
        h = x.tanh()
        y = self.proj(h) if self.calls == 1 else h.exp()
        return y.sin()


@pytest.mark.parametrize("debug", [False, True])
def test_a_replay_that_takes_another_branch_is_named_as_such(debug):
    torch.manual_seed(0)
    model = rt.checkpoint_wrapper(Branchy(), debug=debug)
    out = model(torch.randn(4, 8, requires_grad=True))
    with pytest.raises(recomp.ReplayMismatchError) as info:
        out.sum().backward()
    message = str(info.value)
    assert "replay did not reach excluded region 'proj'" in message
    assert "input args[0]" in message and "counter, a flag" in message
    assert ".detach()" not in message  # not the output-left-the-graph story
    if debug:  # the op listing of both phases, and where they part
        assert "Ops in the forward" in message and "Ops in the replay" in message
        # (op numbers differ between PyTorch versions: the checkpoint's own detaches)
        assert re.search(r"forward op \d+ is aten\.sin\.default, replay op \d+ is aten\.exp", message)
    else:
        assert "Ops in the forward" not in message



def test_every_numbered_rule_is_cited_and_every_citation_exists():
    """The NOTE in recomp/_region.py numbers the rules the engine relies on; the code that
    enforces one cites it as "rule N". A renumbering that leaves stale citations fails here."""
    from pathlib import Path

    import recomp._region as region_module

    src = Path(region_module.__file__).parent
    note = region_module.__doc__ or ""
    rules_text = note.split("Rules the code relies on")[1].split("NOTE [ Deferred inputs ]")[0]
    numbered = {int(n) for n in re.findall(r"^\s+(\d+)\. ", rules_text, flags=re.M)}
    assert numbered == set(range(1, 9))
    cited: set[int] = set()
    for path in src.rglob("*.py"):
        text = path.read_text()
        if path.name == "_region.py":
            text = text.replace(note, "")  # citations only, not the NOTE itself
        cited |= {int(n) for n in re.findall(r"\brules? (\d+)\b", text)}
    assert cited <= numbered, f"citations of rules that do not exist: {sorted(cited - numbered)}"
    assert numbered <= cited, f"rules no code cites: {sorted(numbered - cited)}"
