"""The receiver side of registered IPC pushes: layouts opened once, each with its copy plan.

`register` validates the layout against the shard's parameter table (names, shapes, dtypes —
typed `WeightUpdateError`, nothing opened or written), opens its handles (CUDA IPC opens are
slow: once per layout, not per push) and records the `CopyPlan` of the model's load path over
the opened views (each TP rank's plan reads only its own slice of the trainer's tensors). A push
(`IpcLayoutRef`) is a dictionary lookup; `ProcessedLayout.load` replays the plan and
synchronizes the device once. The newest `MAX_LAYOUTS` layouts are kept; older ones (and the one
a new registration `replaces`) are closed, which lets the trainer reuse that memory."""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from weight_sync.copy_plan import CopyPlan
from weight_sync.errors import WeightUpdateError
from weight_sync.ipc import IpcHandleError
from weight_sync.ipc_layout import IpcLayout, IpcLayoutRef, IpcLayoutUnknownError, OpenedLayout
from weight_sync.spec import TensorSpec

logger = logging.getLogger(__name__)
MAX_LAYOUTS = 2


@dataclass
class ProcessedLayout:
    opened: OpenedLayout
    plan: Optional[CopyPlan]  # None: the load path cannot be planned; load the ordinary way
    allow_partial: bool

    def load(self, target) -> int:
        if self.plan is None:
            return target.load_weights(self.opened.named())
        count = self.plan.run()
        if target.device.type == "cuda":
            torch.cuda.current_stream(target.device).synchronize()
        return count

    def close(self) -> None:
        self.plan = None  # the plan's views first, then the mappings under them
        self.opened.close()


class IpcLayouts:
    def __init__(self):
        self._layouts: OrderedDict[str, ProcessedLayout] = OrderedDict()

    def __contains__(self, layout_id: str) -> bool:
        return layout_id in self._layouts

    def ids(self) -> list[str]:
        return list(self._layouts)

    def get(self, ref: IpcLayoutRef, allow_partial: bool) -> ProcessedLayout:
        entry = self._layouts.get(ref.layout_id)
        if entry is None:
            raise IpcLayoutUnknownError(f"IPC layout {ref.layout_id} is not registered here (new or "
                                        "rebuilt shard, or evicted): the sender must register it again")
        if entry.allow_partial and not allow_partial:
            raise IpcLayoutUnknownError(f"IPC layout {ref.layout_id} was registered as a partial update; "
                                        "register it again for a complete one")
        return entry

    def register(self, layout: IpcLayout, target, allow_partial: bool,
                 validate: Callable[[Sequence[TensorSpec], bool], None]) -> ProcessedLayout:
        entry = self._layouts.get(layout.layout_id)
        if entry is not None and (allow_partial or not entry.allow_partial):
            self._layouts.move_to_end(layout.layout_id)
            return entry
        validate(list(layout.specs), allow_partial)  # before anything is opened or written
        try:
            opened = OpenedLayout(layout, target.device)
        except IpcHandleError as e:
            raise WeightUpdateError(str(e)) from e
        try:
            plan = CopyPlan.record(target.load_weights, opened.named())
        except BaseException:
            opened.close()
            raise
        if plan is None:
            logger.warning("IPC layout %s: the model's load path cannot be replayed as a copy plan; "
                           "every push loads tensor by tensor", layout.layout_id)
        entry = ProcessedLayout(opened, plan, allow_partial)
        self.drop([layout.layout_id, *layout.replaces])
        self._layouts[layout.layout_id] = entry
        while len(self._layouts) > MAX_LAYOUTS:
            self._layouts.popitem(last=False)[1].close()
        return entry

    def drop(self, layout_ids: Optional[Iterable[str]] = None) -> None:
        """Close the given layouts (all when None)."""
        for layout_id in list(self._layouts if layout_ids is None else layout_ids):
            entry = self._layouts.pop(layout_id, None)
            if entry is not None:
                entry.close()
