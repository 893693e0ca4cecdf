"""Where a model's nodes run: worker groups of processes and devices, read from a YAML
file (`omniwalk serve --placement FILE`; docs/placement.md has examples).

    groups:
      - name: main                  # the first group is the engine's: the engine process is its
        nodes: [backbone]           #   rank 0, and every node no group names runs here
        devices: [0]                # one per rank: a GPU index, cuda:N, cpu, or auto (--device)
      - name: codec                 # any other group: a worker process of its own per rank
        nodes: [snac_decoder]       #   (omniwalk/node_workers.py)
        devices: [1]
        tensor_parallel_size: 1     # default: one rank per device named

No file: one group of every node on --device, split --tensor-parallel-size ways
(`Placement.default`), which is what one process always ran. A file is checked in three
passes, each error "FILE:LINE: problem" (`PlacementError`):

    parse_placement     the file alone: YAML, keys and types, a group named twice, a node
                        placed twice, devices that are no device, devices != ranks
    check_model         against the model (from its config, before any weight loads): an
                        unknown node, a GPU this machine lacks, a tensor-parallel size the
                        model's heads do not divide (`ModelFamily.tensor_parallel`)
    check_runnable      what runs today: worker groups of one rank, of nodes the family can
                        build alone (`LoaderSpec.worker_executors`); the engine group's GPUs
                        0..N-1 (a rank's GPU is its rank)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import yaml

if TYPE_CHECKING:
    from omniwalk.graph import Node
    from omniwalk.models.family import ModelFamily

GROUP_KEYS = ("name", "nodes", "devices", "tensor_parallel_size")


class PlacementError(ValueError):
    """A placement file that cannot run: "FILE:LINE: problem"."""

    def __init__(self, source: str, line: int, problem: str):
        super().__init__(f"{source}:{line}: {problem}" if line else f"{source}: {problem}")
        self.source, self.line, self.problem = source, line, problem


@dataclass(frozen=True)
class GroupLines:
    """Where the file declares a group's parts (1-based; 0: not from a file), for errors
    found after parsing."""

    group: int = 0
    nodes: tuple[int, ...] = ()
    devices: int = 0
    tensor_parallel_size: int = 0


@dataclass(frozen=True)
class WorkerGroup:
    """Nodes that run together: in the engine process (the first group) or in worker
    processes of their own, one process and one device per tensor-parallel rank."""

    name: str
    nodes: tuple[str, ...] = ()          # the first group also runs every node no group names
    devices: tuple[str, ...] = ("auto",)  # per rank: "cuda:N", "cpu", or "auto" (EngineArgs.device)
    tensor_parallel_size: int = 1
    lines: GroupLines = field(default=GroupLines(), compare=False, repr=False)

    @property
    def gpus(self) -> tuple[int, ...]:
        """The CUDA indices it names."""
        return tuple(int(device.split(":")[1]) for device in self.devices if device.startswith("cuda:"))


@dataclass(frozen=True)
class Placement:
    """Worker groups of one model; the first is the engine's."""

    groups: tuple[WorkerGroup, ...]
    source: str = "<default placement>"   # the file, for errors

    def __post_init__(self):
        if not self.groups:
            raise PlacementError(self.source, 0, "no worker groups: name at least one under `groups:`")
        seen_groups: dict[str, int] = {}
        seen_nodes: dict[str, str] = {}
        for group in self.groups:
            if group.name in seen_groups:
                raise PlacementError(self.source, group.lines.group, f"a second group named {group.name!r} "
                                     f"(the first is at line {seen_groups[group.name]})")
            seen_groups[group.name] = group.lines.group
            for index, node in enumerate(group.nodes):
                if node in seen_nodes:
                    raise PlacementError(self.source, _at(group.lines.nodes, index, group.lines.group),
                                         f"node {node!r} is placed twice (groups {seen_nodes[node]!r} and "
                                         f"{group.name!r})")
                seen_nodes[node] = group.name
            self._check_ranks(group)

    def _check_ranks(self, group: WorkerGroup) -> None:
        line = group.lines.tensor_parallel_size or group.lines.devices or group.lines.group
        if group.tensor_parallel_size < 1:
            raise PlacementError(self.source, line, f"tensor_parallel_size must be >= 1, got "
                                 f"{group.tensor_parallel_size}")
        if len(group.devices) != group.tensor_parallel_size:
            raise PlacementError(self.source, line, f"group {group.name!r}: {len(group.devices)} devices for "
                                 f"tensor_parallel_size {group.tensor_parallel_size} (one device per rank)")
        gpus = group.gpus
        if len(set(gpus)) != len(gpus):
            raise PlacementError(self.source, group.lines.devices or group.lines.group,
                                 f"group {group.name!r} names a GPU twice: each rank needs its own")

    @classmethod
    def default(cls, tensor_parallel_size: int = 1, device: str = "auto") -> "Placement":
        """What runs without a file: every node in the engine's group, on `device`, split
        `tensor_parallel_size` ways (the shorthand `--tensor-parallel-size N` stands for)."""
        devices = (device,) if tensor_parallel_size == 1 else ("auto",) * tensor_parallel_size   # rank r: GPU r
        return cls((WorkerGroup("engine", (), devices, tensor_parallel_size),))

    @property
    def engine_group(self) -> WorkerGroup:
        return self.groups[0]

    @property
    def worker_groups(self) -> tuple[WorkerGroup, ...]:
        """The groups that run in worker processes of their own."""
        return self.groups[1:]

    @property
    def worker_nodes(self) -> frozenset[str]:
        """The nodes that run in worker processes: the engine process does not load them."""
        return frozenset(node for group in self.worker_groups for node in group.nodes)

    def group_of(self, node: str) -> WorkerGroup:
        return next((group for group in self.groups if node in group.nodes), self.engine_group)

    def named_nodes(self) -> list[tuple[str, WorkerGroup, int]]:
        """(node, its group, its line) for every node the file names."""
        return [(node, group, _at(group.lines.nodes, index, group.lines.group))
                for group in self.groups for index, node in enumerate(group.nodes)]


def _at(lines: tuple[int, ...], index: int, default: int) -> int:
    return lines[index] if index < len(lines) else default


# ----------------------------------------------------------------------------- parsing


def load_placement(path: str | Path) -> Placement:
    """The placement file at `path`, parsed and checked on its own (`parse_placement`)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PlacementError(str(path), 0, f"cannot read the placement file ({exc.strerror or exc})") from None
    return parse_placement(text, str(path))


def parse_placement(text: str, source: str = "<placement>") -> Placement:
    """A placement from YAML text; errors name `source` and the line."""
    try:
        # composed, not loaded: the nodes keep their lines for the errors found later
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise PlacementError(source, mark.line + 1 if mark else 0, f"not YAML: {exc.problem or exc}") from None
    if root is None:
        raise PlacementError(source, 0, "the file is empty: it needs `groups:`")
    mapping = _mapping(root, source, "the file", ("groups",))
    if "groups" not in mapping:
        raise PlacementError(source, _line(root), "no `groups:`")
    groups = mapping["groups"][1]
    if not isinstance(groups, yaml.SequenceNode):
        raise PlacementError(source, _line(groups), "`groups` must be a list of groups (- name: ...)")
    return Placement(tuple(_group(node, source) for node in groups.value), source)


def _group(node: yaml.Node, source: str) -> WorkerGroup:
    keys = _mapping(node, source, "a group", GROUP_KEYS)
    if "name" not in keys:
        raise PlacementError(source, _line(node), "a group without a `name`")
    name = _scalar(keys["name"][1], source, str, "name")
    lines = GroupLines(group=_line(node))
    nodes: tuple[str, ...] = ()
    if "nodes" in keys:
        items = _sequence(keys["nodes"][1], source, "nodes")
        nodes = tuple(_scalar(item, source, str, "a node name") for item in items)
        lines = replace(lines, nodes=tuple(_line(item) for item in items))
    devices = None
    if "devices" in keys:
        items = _sequence(keys["devices"][1], source, "devices")
        devices = tuple(_device(item, source) for item in items)
        lines = replace(lines, devices=_line(keys["devices"][0]))
    size = None
    if "tensor_parallel_size" in keys:
        size = _scalar(keys["tensor_parallel_size"][1], source, int, "tensor_parallel_size")
        lines = replace(lines, tensor_parallel_size=_line(keys["tensor_parallel_size"][0]))
    if size is None:
        size = len(devices) if devices else 1
    if devices is None:
        devices = ("auto",) * max(size, 1)
    return WorkerGroup(name, nodes, devices, size, lines)


def _device(node: yaml.Node, source: str) -> str:
    """A GPU index or cuda:N -> "cuda:N"; "cpu" and "auto" as they are."""
    value = _scalar(node, source, (int, str), "a device")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"cuda:{value}"
    text = str(value).strip().lower()
    if text in ("cpu", "auto"):
        return text
    if text == "cuda":
        return "cuda:0"
    if text.startswith("cuda:") and text[5:].isdigit():
        return f"cuda:{int(text[5:])}"
    raise PlacementError(source, _line(node), f"device {value!r}: expected a GPU index (0, 1, ...), cuda:N, "
                         f"cpu or auto")


def _mapping(node: yaml.Node, source: str, what: str, allowed: tuple[str, ...]) -> dict[str, tuple]:
    """key -> (key node, value node), unknown and repeated keys refused."""
    if not isinstance(node, yaml.MappingNode):
        raise PlacementError(source, _line(node), f"{what} must be a mapping (key: value), with "
                             f"{', '.join(allowed)}")
    found: dict[str, tuple] = {}
    for key, value in node.value:
        name = key.value if isinstance(key, yaml.ScalarNode) else None
        if name not in allowed:
            raise PlacementError(source, _line(key), f"unknown key {name!r} in {what} (expected "
                                 f"{', '.join(allowed)})")
        if name in found:
            raise PlacementError(source, _line(key), f"{name!r} given twice in {what}")
        found[name] = (key, value)
    return found


def _sequence(node: yaml.Node, source: str, what: str) -> list[yaml.Node]:
    if isinstance(node, yaml.ScalarNode):   # `nodes: snac_decoder` for `nodes: [snac_decoder]`
        return [node]
    if not isinstance(node, yaml.SequenceNode):
        raise PlacementError(source, _line(node), f"{what} must be a list")
    return list(node.value)


_CONSTRUCTOR = yaml.constructor.SafeConstructor()
_KINDS = {int: "an integer", str: "a string"}


def _scalar(node: yaml.Node, source: str, kind, what: str) -> Any:
    value = _CONSTRUCTOR.construct_object(node, deep=True) if isinstance(node, yaml.ScalarNode) else None
    if value is None or isinstance(value, bool) or not isinstance(value, kind):
        names = " or ".join(_KINDS[k] for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise PlacementError(source, _line(node), f"{what} must be {names}, got {_shown(node)}")
    return value


def _shown(node: yaml.Node) -> str:
    return repr(node.value) if isinstance(node, yaml.ScalarNode) else f"a {node.id}"


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


# ----------------------------------------------------------------------------- the model and the machine


def check_model(placement: Placement, family: "ModelFamily", config: Any, nodes: Mapping[str, "Node"] | None,
                num_gpus: int, workers_here: bool = True) -> None:
    """`placement` against the model (its `nodes`: None where the family cannot tell them
    before loading; then `check_nodes` runs after) and this machine's `num_gpus` (the
    engine group's only when the worker groups run elsewhere: `workers_here` False, on Ray,
    which finds their GPUs in its cluster)."""
    if nodes is not None:
        check_nodes(placement, nodes, family.name)
    for group in placement.groups if workers_here else (placement.engine_group,):
        for device in group.gpus:
            if device >= num_gpus:
                raise PlacementError(placement.source, group.lines.devices or group.lines.group,
                                     f"device cuda:{device} is out of range: this machine has "
                                     + (f"{num_gpus} GPUs (0-{num_gpus - 1})" if num_gpus else "no GPU (use cpu)"))
    engine = placement.engine_group   # the family's split check is the decoder's, which runs there
    size = engine.tensor_parallel_size
    if size > 1:
        line = engine.lines.tensor_parallel_size or engine.lines.devices or engine.lines.group
        if family.tensor_parallel is None:
            raise PlacementError(placement.source, line, f"tensor_parallel_size {size}: {family.name} models run "
                                 f"on one device only")
        try:
            family.tensor_parallel(config, size)
        except ValueError as exc:
            raise PlacementError(placement.source, line, str(exc)) from None


def check_nodes(placement: Placement, nodes: Mapping[str, "Node"], family_name: str) -> None:
    """Every node the file names is one of the model's."""
    for node, _, line in placement.named_nodes():
        if node not in nodes:
            raise PlacementError(placement.source, line, f"unknown node {node!r}: {family_name} models have "
                                 f"{', '.join(nodes)}")


def check_runnable(placement: Placement, family: "ModelFamily") -> None:
    """What of a valid placement runs today (docs/placement.md, "What runs today")."""
    engine = placement.engine_group
    if engine.tensor_parallel_size > 1 and engine.gpus and engine.gpus != tuple(range(engine.tensor_parallel_size)):
        raise PlacementError(placement.source, engine.lines.devices or engine.lines.group,
                             f"group {engine.name!r}: tensor-parallel ranks run on GPUs 0..N-1 (rank r on GPU r) "
                             f"only yet, not {list(engine.gpus)}")
    if len({device.split(':')[0] for device in engine.devices}) > 1:
        raise PlacementError(placement.source, engine.lines.devices or engine.lines.group,
                             f"group {engine.name!r} mixes kinds of device")
    if engine.tensor_parallel_size > 1 and placement.worker_groups:
        group = placement.worker_groups[0]
        raise PlacementError(placement.source, group.lines.group, f"group {group.name!r}: worker groups beside a "
                             f"tensor-parallel engine group do not run yet")
    placeable = family.loader.worker_executors
    for group in placement.worker_groups:
        if group.tensor_parallel_size > 1:
            raise PlacementError(placement.source, group.lines.tensor_parallel_size or group.lines.devices
                                 or group.lines.group, f"group {group.name!r}: a worker group of several ranks does not run yet (only "
                                 f"the first, the engine's group, splits over tensor-parallel ranks)")
        if not group.nodes:
            raise PlacementError(placement.source, group.lines.group, f"group {group.name!r} names no nodes")
        for index, node in enumerate(group.nodes):
            if node not in placeable:
                can = ", ".join(placeable) or "none of its nodes"
                raise PlacementError(placement.source, _at(group.lines.nodes, index, group.lines.group),
                                     f"node {node!r} cannot run outside the engine's group yet ({family.name}: "
                                     f"{can} can)")


def engine_flags(placement: Placement, tensor_parallel_size: int | None, device: str) -> tuple[int, str]:
    """The engine's (tensor_parallel_size, device) under `placement`, given the flags:
    `--tensor-parallel-size` (None: not given) must agree with the engine group's size, and
    `--device` (auto: not given) with its devices."""
    engine = placement.engine_group
    size = engine.tensor_parallel_size
    if tensor_parallel_size is not None and tensor_parallel_size != size:
        raise PlacementError(placement.source, engine.lines.tensor_parallel_size or engine.lines.group,
                             f"--tensor-parallel-size {tensor_parallel_size} but group {engine.name!r} has "
                             f"tensor_parallel_size {size}: give one of them, or the same size")
    named = engine.devices[0]
    if named == "auto":
        return size, device
    # ranks of one group set their GPU by rank (engine/tensor_parallel.py): under TP the kind only
    wanted = named if size == 1 else named.split(":")[0]
    if device != "auto" and device != wanted and device != named:
        raise PlacementError(placement.source, engine.lines.devices or engine.lines.group,
                             f"--device {device} but group {engine.name!r} runs on {named}")
    return size, wanted
