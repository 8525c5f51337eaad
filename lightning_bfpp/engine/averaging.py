"""A running average of this rank's weights (EMA, SWA), held and updated shard by shard, like the weights.

torch's :class:`~torch.optim.swa_utils.AveragedModel` deep-copies the whole model and walks its parameters
beside the model's. Under the pipeline a rank holds the parameters of its own stages only, sharded (DTensors
under FSDP2 or tensor parallelism), so :class:`LocalAveragedModel` copies exactly those: a module that mirrors
the rank's module tree (same names, the same parameter and buffer order, nothing of other ranks' layers) with a
copy of each tensor that keeps its sharding. Swapping weights with the average (validation) and copying them
back (the end of training) then stay local copies, and the average's ``state_dict`` holds this rank's shards
under the model's own names, which a distributed checkpoint stores and reloads in any layout.

The update itself is torch's ``AveragedModel.update_parameters``, run over each tensor's local shard: every
averaging function is elementwise, so averaging the shards is averaging the model, and torch's code (its
first-update copy, its ``avg_fn`` / ``multi_avg_fn`` / foreach paths, ``use_buffers``) is kept as it is rather
than rewritten. (Run on the DTensors, its ``n_averaged`` tensor would meet sharded tensors in one operation.)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel


def mirror(module: nn.Module) -> nn.Module:
    """A module tree with ``module``'s names that holds ``module``'s own parameters and buffers (no copy).

    Built from ``named_modules`` so that ``parameters()`` and ``buffers()`` come in ``module``'s order; a
    module or a tensor reached under two names is one object here too. Non-persistent buffers stay so."""
    persistent = set(module.state_dict(keep_vars=True))
    copies: dict[int, nn.Module] = {}
    root = nn.Module()
    for name, child in module.named_modules(remove_duplicate=False):
        if id(child) in copies:
            node = copies[id(child)]
        else:
            node = root if not name else nn.Module()
            copies[id(child)] = node
            prefix = f"{name}." if name else ""
            for pname, param in child.named_parameters(recurse=False, remove_duplicate=False):
                node.register_parameter(pname, param)
            for bname, buffer in child.named_buffers(recurse=False, remove_duplicate=False):
                node.register_buffer(bname, buffer, persistent=prefix + bname in persistent)
        if name:
            parent, _, leaf = name.rpartition(".")
            root.get_submodule(parent).add_module(leaf, node)
    return root


def local(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: its local shard for a DTensor (the same storage), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _LocalShards:
    """A module's parameters and buffers as their local shards, for ``AveragedModel.update_parameters``."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def parameters(self) -> Iterator[Tensor]:
        return (local(p) for p in self._module.parameters())

    def buffers(self) -> Iterator[Tensor]:
        return (local(b) for b in self._module.buffers())


class _AverageShards(_LocalShards):
    """What ``AveragedModel.update_parameters`` reads of ``self``, with every tensor as its local shard: the
    average's parameters (``self.parameters()``, ``self.module.parameters()``), ``n_averaged`` (updated in
    place), ``avg_fn``, ``multi_avg_fn``, ``use_buffers``."""

    def __init__(self, average: LocalAveragedModel) -> None:
        super().__init__(average.module)
        self.module = _LocalShards(average.module)
        self._average = average

    def __getattr__(self, name: str) -> Any:
        return getattr(self._average, name)


class LocalAveragedModel(AveragedModel):
    """``AveragedModel`` over the parameters and buffers this rank holds, each averaged in its own sharding.

    ``module`` is the rank's module after its stages are placed and sharded; ``update_parameters(module)``
    must be given that same module. Arguments are ``AveragedModel``'s; ``avg_fn`` / ``multi_avg_fn`` receive
    local shards (every averaging function is elementwise). ``device``: where the average is kept, if not
    with the weights.
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device | None = None,
        avg_fn: Callable[[Tensor, Tensor, Tensor | int], Tensor] | None = None,
        multi_avg_fn: Callable[[list[Tensor], list[Tensor], Tensor | int], None] | None = None,
        use_buffers: bool = False,
    ) -> None:
        view = mirror(module)
        if (ours := list(view.state_dict())) != (theirs := list(module.state_dict())):
            missing = sorted(set(theirs) - set(ours)) or sorted(set(ours) - set(theirs))
            raise ValueError(
                "BFPPStrategy cannot average this module's weights: its `state_dict` names differ from its"
                f" parameters' and buffers' names (e.g. {missing[:3]}; a state_dict hook?), so the averaged"
                " weights could not be saved under the model's names. Remove the hook, or average the weights"
                " inside the module."
            )
        # AveragedModel deep-copies the view: one copy of each local tensor, its sharding kept
        super().__init__(view, device=device, avg_fn=avg_fn, multi_avg_fn=multi_avg_fn, use_buffers=use_buffers)
        self._shapes = _shapes(module)

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        if (shapes := _shapes(model)) != self._shapes:
            raise RuntimeError(
                f"LocalAveragedModel: the module holds {len(shapes)} tensors now and held {len(self._shapes)}"
                " (or other shapes) when the average was made; its parameters must stay the ones the stages"
                " were placed with."
            )
        AveragedModel.update_parameters(_AverageShards(self), _LocalShards(model))  # type: ignore[arg-type]


def _shapes(module: nn.Module) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in itertools.chain(module.parameters(), module.buffers())]
