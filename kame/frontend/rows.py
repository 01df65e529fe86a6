"""Step the talking sessions only: views of the first n rows of moshi's streaming state.

moshi creates a module's streaming state for a fixed batch (`streaming(B)`), and a step computes every
row of it, whichever rows its exec mask lets change. `RowViews` keeps one set of states of B rows as the
storage and installs, for a step, states whose tensors are views of its first n rows, so a step over n
rows costs a batch of n. The engine keeps its live sessions' rows contiguous at the front (the last one
moves into a hole when a session leaves: `move_row`), so n is the number of sessions, not of slots.

Each view has its own CUDA graphs (moshi keeps them in the states), captured on the views' fixed
addresses, so a graph per size bucket replays on the same storage. A step that assigns a new tensor to a
state field (LMGen's `offsets`) is written back into the storage by `sync`. A state this module does not
know (another moshi version, classifier-free guidance's doubled batch) raises `RowsUnsupported`: the
engine then steps the whole batch as before.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Sequence

import torch
from moshi.modules.streaming import StreamingModule
from moshi.modules.transformer import RingKVCache
from moshi.utils.compile import CUDAGraphed

# the batch axis of each tensor field of moshi 0.2.13's streaming states, by state class; every state has
# `exec_mask` (moshi's State.__post_init__). A field of another class, or a tensor field not named here,
# makes the state unsupported (read moshi's dataclass and add it: the tests step views against the batch)
BATCH_AXES: dict[str, dict[str, int]] = {
    "State": {},
    "_StreamingConv1dState": {"previous": 0, "first": 0},
    "_StreamingConvTr1dState": {"partial": 0},
    "_MHAState": {"offset": 0, "k_cross": 0, "v_cross": 0},
    "_LayerState": {},
    "_TransformerState": {"offsets": 0},
    "_MimiState": {},
    "_LMGenState": {"cache": 0, "offsets": 0, "condition_sum": 0, "condition_cross": 0},
}
SHARED_TENSORS = {"initial", "cfg_is_masked_until"}  # _LMGenState's: one for every row
BROADCAST = {"condition_sum", "condition_cross"}  # a fuser's conditions may be [1, ...]: shared then
PLAIN = (int, float, bool, str, type(None), torch.device, contextlib.ExitStack)

logger = logging.getLogger(__name__)


class RowsUnsupported(Exception):
    """A streaming state this module cannot view by rows; says which field."""


class _Field:
    """A batched tensor field of one view state (or of its KV cache), and the view of the storage it must
    hold after a step."""

    __slots__ = ("owner", "name", "view")

    def __init__(self, owner: object, name: str, view: torch.Tensor) -> None:
        self.owner, self.name, self.view = owner, name, view


class RowViews:
    """Views of the first n rows of the streaming states of `roots` (each streaming at `batch_size`)."""

    def __init__(self, roots: Sequence[StreamingModule], batch_size: int) -> None:
        self.roots, self.batch_size = list(roots), batch_size
        self._storage = [root.get_streaming_state() for root in self.roots]
        self._tensors = self._storage_tensors()
        self._views: dict[int, tuple[list[dict[str, object]], list[_Field]]] = {}
        self.installed: int | None = None

    def _storage_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every batched tensor of the storage, once (and a check that each state is one this module knows)."""
        seen: dict[int, tuple[torch.Tensor, int]] = {}
        for states in self._storage:
            for name, state in states.items():
                for _, _, tensor, axis in _batched(name, state, self.batch_size):
                    seen.setdefault(id(tensor), (tensor, axis))
        return list(seen.values())

    def move_row(self, source: int, target: int) -> None:
        """Copy row `source` of every batched tensor onto row `target` (a live row filling a hole)."""
        for tensor, axis in self._tensors:
            tensor.select(axis, target).copy_(tensor.select(axis, source))

    def install(self, n: int) -> None:
        """Make the roots' states the views of the first `n` rows (built once per n, then kept)."""
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"a view holds 1 to {self.batch_size} rows, not {n}")
        if self.installed == n:
            return
        if n not in self._views:
            self._views[n] = self._build(n)
        for root, states in zip(self.roots, self._views[n][0], strict=True):
            root.set_streaming_state(states)
        self.installed = n

    def sync(self) -> None:
        """Write back what the last step assigned anew to a field of the installed view (moshi's LMGen
        replaces its `offsets` each step), so that the storage stays the one truth for every view."""
        if self.installed is None:
            return
        for field in self._views[self.installed][1]:
            current = getattr(field.owner, field.name)
            if current is not field.view:
                field.view.copy_(current)
                setattr(field.owner, field.name, field.view)

    def _build(self, n: int) -> tuple[list[dict[str, object]], list[_Field]]:
        fields: list[_Field] = []
        states = [{name: _view_state(name, state, n, self.batch_size, fields) for name, state in storage.items()}
                  for storage in self._storage]
        return states, fields


def _axes_of(state: object) -> dict[str, int]:
    axes: dict[str, int] = {"exec_mask": 0}
    known = False
    for klass in type(state).__mro__:
        if klass.__name__ in BATCH_AXES:
            axes.update(BATCH_AXES[klass.__name__])
            known = known or klass is type(state)
    if not known:
        raise RowsUnsupported(f"unknown streaming state {type(state).__name__}")
    return axes


def _batched(name: str, state: object, batch: int):
    """(owner, field, tensor, axis) of each batched tensor of `state` and of its KV cache."""
    axes = _axes_of(state)
    for field, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            axis = _axis(name, type(state).__name__, field, value, axes, batch)
            if axis is not None:
                yield state, field, value, axis
        elif isinstance(value, RingKVCache):
            yield from _kv_fields(name, value, batch)
        elif not _plain(field, value):
            raise RowsUnsupported(f"{name}: field {field} holds a {type(value).__name__}")


def _axis(name: str, kind: str, field: str, value: torch.Tensor, axes: dict[str, int], batch: int) -> int | None:
    if field in SHARED_TENSORS:
        return None
    if field not in axes:
        raise RowsUnsupported(f"{name}: tensor field {kind}.{field} has no known batch axis")
    axis = axes[field]
    if value.dim() > axis and value.shape[axis] == batch:
        return axis
    if field in BROADCAST and value.dim() > axis and value.shape[axis] == 1:
        return None
    raise RowsUnsupported(f"{name}: {kind}.{field} has shape {tuple(value.shape)}, not {batch} rows on axis {axis}")


def _kv_fields(name: str, cache: RingKVCache, batch: int):
    if cache.cache.shape[1] != batch:
        raise RowsUnsupported(f"{name}: a KV cache of {cache.cache.shape[1]} rows, not {batch}")
    yield cache, "cache", cache.cache, 1
    scale = getattr(cache, "scale", None)  # an int8 cache's scales (kame/frontend/kv_cache.py)
    if scale is not None:
        yield cache, "scale", scale, 1
    if cache.respect_exec_mask:
        yield cache, "end_offset", cache.end_offset, 0


def _plain(field: str, value: object) -> bool:
    return isinstance(value, (*PLAIN, CUDAGraphed)) or callable(value)


def _view_state(name: str, state: object, n: int, batch: int, fields: list[_Field]) -> object:
    """A shallow copy of `state` whose batched tensors are views of its first n rows, with CUDA graphs
    of its own (captured on those views' addresses)."""
    view = copy.copy(state)
    view.batch_size = n
    caches: dict[int, RingKVCache] = {}
    for owner, field, tensor, axis in _batched(name, state, batch):
        target = view
        if isinstance(owner, RingKVCache):
            if id(owner) not in caches:
                caches[id(owner)] = copy.copy(owner)
                setattr(view, _attribute_holding(state, owner), caches[id(owner)])
            target = caches[id(owner)]
        narrowed = tensor.narrow(axis, 0, n)
        setattr(target, field, narrowed)
        fields.append(_Field(target, field, narrowed))
    for field, value in vars(state).items():
        if isinstance(value, CUDAGraphed):
            setattr(view, field, CUDAGraphed(value.func, disable=value.disable))
    if hasattr(view, "_set_exec_mask_graphed"):
        view._set_exec_mask_graphed = None
    return view


def _attribute_holding(state: object, value: object) -> str:
    return next(field for field, held in vars(state).items() if held is value)


def row_buckets(batch_size: int, cuda: bool) -> Callable[[int], int]:
    """The view size a step over n live rows uses: n itself on a CPU; on CUDA the next power of two (or
    the batch), so that a handful of sizes each keep their captured graphs."""
    if not cuda:
        return lambda n: max(1, n)
    sizes = sorted({min(2**k, batch_size) for k in range(batch_size.bit_length() + 1)})
    return lambda n: next(size for size in sizes if size >= max(1, n))


class SlotRows:
    """Which row of a batch each acquired slot holds: the live ones first, so a step needs only the first
    rows (their number rounded to a view size). Slots are the sessions' stable names; rows move: when a
    slot leaves, the last live row moves into its hole (`release` says which move to make, and the
    caller moves whatever else it keeps per row). Without views (`views=None`) a slot's row is the slot,
    and every step is the whole batch, as before.

    Also installs the views: `view(rows)` makes the model's state the first n rows (n >= `rows` and the
    live rows), `sync()` after a step writes back what moshi assigned anew."""

    def __init__(self, batch_size: int, views: RowViews | None, cuda: bool) -> None:
        self.batch_size, self.views = batch_size, views
        self.bucket = row_buckets(batch_size, cuda)
        self._row_of: dict[int, int] = {}  # acquired slot -> its row
        self._slot_at: list[int | None] = [None] * batch_size  # row -> the slot it holds

    @property
    def live(self) -> int:
        return len(self._row_of)

    def row(self, slot: int) -> int:
        return self._row_of[slot]

    def slot_at(self, row: int) -> int | None:
        return self._slot_at[row]

    def take(self, slot: int) -> int:
        """`slot` is acquired: its row (the first after the live ones)."""
        row = self.live if self.views is not None else slot
        self._row_of[slot], self._slot_at[row] = row, slot
        return row

    def release(self, slot: int) -> tuple[int, int] | None:
        """`slot` left: (source, target) when the last live row must move into its hole (done here for the
        model's state; the caller moves its own per-row state), else None."""
        row = self._row_of.pop(slot)
        self._slot_at[row] = None
        last = self.live
        if self.views is None or row == last:
            return None
        self.views.move_row(last, row)
        moved = self._slot_at[last]
        self._slot_at[last], self._slot_at[row] = None, moved
        self._row_of[moved] = row
        return last, row

    def reset(self, slot: int, modules: Sequence[StreamingModule], device: torch.device) -> None:
        """Reset the slot's row of each module's streaming state (moshi's `reset_streaming` on a view)."""
        row = self.row(slot)
        n = self.view(row + 1)
        mask = torch.zeros(n, dtype=torch.bool, device=device)
        mask[row] = True
        try:
            for module in modules:
                module.reset_streaming(mask)
        finally:
            self.sync()

    def view_size(self) -> int:
        """Rows a step runs now: the live ones, rounded to a view size (the batch without views)."""
        return self.bucket(self.live) if self.views is not None else self.batch_size

    def view(self, rows: int = 1) -> int:
        """Install a view of at least `rows` rows and of the live ones; its size."""
        if self.views is None:
            return self.batch_size
        n = self.bucket(max(rows, self.live))
        self.views.install(n)
        return n

    def sizes(self) -> list[int]:
        """Every view size a step can use (what warming up captures on CUDA)."""
        return sorted({self.bucket(n) for n in range(1, self.batch_size + 1)})

    def sync(self) -> None:
        if self.views is not None:
            self.views.sync()


def row_views(roots: Sequence[StreamingModule], batch_size: int, compact: bool, what: str) -> RowViews | None:
    """Views by rows of `roots`' streaming state, or None: each step runs the whole batch (asked for, a
    batch of one, or a state this moshi has that this module does not know: said in the log)."""
    if not compact or batch_size == 1:
        return None
    try:
        return RowViews(roots, batch_size)
    except RowsUnsupported as exc:
        logger.warning("%s: each step runs all %d slots (%s)", what, batch_size, exc)
        return None
