"""The typed interfaces through which other parts of recomp take part in a checkpoint call
or watch and change a region call.

A **checkpoint call** is assembled from parts (:class:`CallPart`): each part may give a
context for the forward and one for the replays, and hears when the forward ends and
when a replay starts. The kept-replay handle, the debug log, the running statistics, the
replay's random state, the user's ``context_fn``, the collective record and MindSpore's
first-forward watch are parts; ``recomp._engine`` composes them, in the order of
:class:`Stage` (NOTE [ The parts of a checkpoint call ] there).

Two kinds of parties take part in an excluded-region call besides the engine:

* **observers** (:class:`RegionObserver`) watch it: the debug report's op log,
  the test seam (``recomp._testing``), memory reports. They are installed for a
  stretch of code with :func:`observing` (a context variable, so per thread and
  task) and see every region call that starts there. Each method has a no-op
  default; an observer overrides what it needs.
* a **placement** (:class:`Placement`) decides where the tensors a region keeps
  live while they wait for backward. The default, no placement, keeps them as
  device aliases. ``offload=True`` (``recomp.torch._offload``) is the other
  implementation: host copies.

Neither is allowed to change what the region computes, only to watch it or
move its kept tensors. This module imports nothing of recomp.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol


class RegionCallView(Protocol):
    """What an observer may read of a region call (``recomp._region.RegionCall``)."""

    @property
    def region_name(self) -> str:
        """The region's name, as in recomp's error messages."""

    @property
    def region(self) -> Any:
        """The ``recomp._region.ExcludedRegion`` the call belongs to."""


class CheckpointCallView(Protocol):
    """What a part may read of the checkpoint call it belongs to
    (``recomp._engine.CheckpointCall``)."""

    #: the call's ``recomp._record.Invocation``
    invocation: Any
    #: an enclosing recomp checkpoint's replay re-runs a call whose forward already ran
    rerun: bool
    #: the call runs inside another recomp checkpoint
    nested: bool


class Stage(enum.IntEnum):
    """Where a part's contexts sit among a checkpoint call's, outermost first. Parts of
    one stage are entered in the order they were given. Why each stage is where it is:
    NOTE [ The parts of a checkpoint call ] in ``recomp._engine``."""

    KEPT_REPLAYS = 10
    RECOMPUTE_STATE = 20
    VALUE_CHECK = 25
    RESTORED_STATE = 30
    DEBUG_LOG = 40
    USER = 50
    OP_RECORDER = 60
    COLLECTIVES = 70
    FIRST_FORWARD_WATCH = 80
    REPLAY_ERRORS = 90


class CallPart:
    """One part of a checkpoint call besides the engine; every method does nothing unless
    overridden. A part is made for one call of the framework's checkpoint.

    ``contexts`` is asked once, when the framework's checkpoint starts the call: it gives
    the context entered around the forward and the one entered around each replay (None
    for neither). The replay context must be re-enterable: every backward that needs the
    call replays it (``retain_graph``).
    """

    # Subclasses that declare their own slots hold no dictionary (a part is made per call).
    __slots__ = ()

    #: Where the part's contexts are entered (see :class:`Stage`).
    stage: ClassVar[Stage]
    #: Whether the class overrides :meth:`replay_started` / :meth:`forward_ended` (set
    #: for each subclass when it is defined): the engine tells only the parts that hear.
    hears_replay: ClassVar[bool] = False
    hears_end: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.hears_replay = cls.replay_started is not CallPart.replay_started
        cls.hears_end = cls.forward_ended is not CallPart.forward_ended

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        """The forward context and the replay context of ``call`` (either may be None)."""
        return None, None

    def forward_ended(self, ok: bool) -> None:
        """The call's forward returned (``ok``) or raised; the invocation has already
        dropped what no replay will reach (early stop)."""

    def replay_started(self) -> None:
        """A replay of the call begins; the invocation's cursors are back at the start."""


class RegionObserver:
    """Watches checkpoint and excluded-region calls; every method does nothing unless
    overridden."""

    def checkpoint_started(self, invocation: Any, function: Any) -> None:
        """A checkpoint call's forward begins (not its replay): ``invocation`` is its
        record (``recomp._record.Invocation``), ``function`` what it checkpoints."""

    def region_started(self, call: RegionCallView) -> None:
        """The region's forward is about to run."""

    def region_finished(self, call: RegionCallView, ok: bool) -> None:
        """The region's forward returned (``ok``) or raised."""

    def region_skipped(self, call: RegionCallView) -> None:
        """A replay reached the region and gets the cached outputs instead of running it."""

    def region_outputs_returned(self, call: RegionCallView) -> None:
        """The skipped region's cached outputs were handed to the replay (the ops between
        this and ``region_skipped`` are recomp's own: views, the boundary)."""

    def tensor_kept(self, call: RegionCallView, original: Any, kept: Any) -> None:
        """An activation the region's autograd saved is kept for backward (``kept`` is
        the alias recomp holds, or None when a placement took it elsewhere).
        Parameters are not reported."""

    def tensor_deferred(self, call: RegionCallView, original: Any, is_view: bool) -> None:
        """A saved tensor is (a view of) a region input that the replay rebuilds, so
        the region keeps only a handle to it (see NOTE [ Deferred inputs ])."""

    def output_cached(self, call: RegionCallView, output: Any, nbytes: int) -> None:
        """A tensor output is cached for the replay; ``nbytes`` is what it adds beyond
        the storages the region already keeps (0 when shared)."""

    def boundary_applied(self, call: RegionCallView, saved: list[Any], outputs: list[Any]) -> None:
        """The forward put the region's outputs through the boundary (see NOTE
        [ Deferred inputs ]), saving ``saved`` under the checkpoint's hook."""

    def explain(self, message: str) -> str:
        """An error about a call this observer saw is raised later, in backward: return
        its message, with whatever the observer can add (the debug report adds its op
        listing)."""
        return message


#: The observers installed here (an empty tuple in normal use); read on every region call.
OBSERVERS: contextvars.ContextVar[tuple[RegionObserver, ...]] = contextvars.ContextVar(
    "recomp_region_observers", default=()
)


@contextlib.contextmanager
def observing(observer: RegionObserver) -> Iterator[None]:
    """Report every region call that starts inside the block to ``observer`` too."""
    token = OBSERVERS.set((*OBSERVERS.get(), observer))
    try:
        yield
    finally:
        OBSERVERS.reset(token)


class Held(Protocol):
    """A kept tensor that a placement moved away from its device alias."""

    def get(self) -> Any:
        """The tensor, back where backward needs it."""

    def changed(self) -> bool:
        """Whether the original was changed in place before the placement had it all."""


class Placement(Protocol):
    """Where one region call keeps its tensors; see the module docstring. A placement
    whose placer also holds the checkpoint's saved inputs, one record per storage (an
    offload session, pipeline swap), says so with a true ``holds_checkpoint_inputs``
    attribute: the region then gives it what it keeps of those inputs too, instead of
    an alias that would hold them on the device."""

    def put(self, tensor: Any) -> Held | None:
        """Take ``tensor`` (a saved tensor or cached output); None leaves it a device alias."""

    def close(self) -> None:
        """The region returned and its outputs are recorded."""

    def abort(self) -> None:
        """The region raised: finish or drop whatever is in flight."""

    def prefetch(self) -> None:
        """A replay reached the region: its backward comes later in this pass."""


class Placer(Protocol):
    """A region option that opens one :class:`Placement` per region call."""

    def open_group(self, name: str) -> Placement | None:
        """The placement for a call of region ``name``; None keeps its tensors as aliases."""
