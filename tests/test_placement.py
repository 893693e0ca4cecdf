"""The placement file (omniwalk/placement.py, issue 27): parsed with its lines, checked
against the model before any weight loads, and reconciled with `--tensor-parallel-size`
and `--device`. Running a placement: tests/distributed/test_node_workers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniwalk.cli import _engine_args, build_parser, main
from omniwalk.loading import EngineArgs, read_model
from omniwalk.placement import Placement, PlacementError, WorkerGroup, load_placement, parse_placement

ORPHEUS_SPLIT = Path(__file__).parent / "distributed" / "orpheus_split.yaml"   # what test_node_workers.py runs


def test_a_file_reads_as_its_groups():
    placement = load_placement(ORPHEUS_SPLIT)
    assert placement.groups == (WorkerGroup("backbone", ("backbone",), ("cpu",)),
                                WorkerGroup("codec", ("snac_decoder",), ("cpu",)))
    assert placement.engine_group.name == "backbone" and [g.name for g in placement.worker_groups] == ["codec"]
    assert placement.group_of("snac_decoder").name == "codec"
    assert placement.group_of("anything else").name == "backbone"   # unnamed nodes run in the engine's group
    tp = parse_placement("groups:\n  - name: main\n    devices: [0, 'cuda:1', cuda:2, 3]\n")
    assert tp.engine_group.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert tp.engine_group.tensor_parallel_size == 4 and tp.engine_group.gpus == (0, 1, 2, 3)
    assert Placement.default(2).engine_group.tensor_parallel_size == 2


@pytest.mark.parametrize("text, error", [
    ("groups:\n  - name: [a\n", r"p.yaml:3: not YAML"),
    ("", r"p.yaml: the file is empty"),
    ("nodes: [a]\n", r"p.yaml:1: unknown key 'nodes' in the file \(expected groups\)"),
    ("groups:\n  - name: a\n    node: [x]\n", r"p.yaml:3: unknown key 'node' in a group"),
    ("groups:\n  - nodes: [x]\n", r"p.yaml:2: a group without a `name`"),
    ("groups:\n  - name: a\n  - name: a\n", r"p.yaml:3: a second group named 'a' \(the first is at line 2\)"),
    ("groups:\n  - name: a\n    nodes: [x, y]\n  - name: b\n    nodes:\n      - z\n      - y\n",
     r"p.yaml:7: node 'y' is placed twice \(groups 'a' and 'b'\)"),
    ("groups:\n  - name: a\n    devices: [tpu]\n", r"p.yaml:3: device 'tpu': expected a GPU index"),
    ("groups:\n  - name: a\n    devices: [0, 0]\n", r"p.yaml:3: group 'a' names a GPU twice"),
    ("groups:\n  - name: a\n    devices: [0]\n    tensor_parallel_size: 2\n",
     r"p.yaml:4: group 'a': 1 devices for tensor_parallel_size 2 \(one device per rank\)"),
    ("groups:\n  - name: a\n    tensor_parallel_size: two\n", r"p.yaml:3: tensor_parallel_size must be an integer, got 'two'"),
])
def test_a_bad_file_names_its_line(text, error):
    with pytest.raises(PlacementError, match=error):
        parse_placement(text, "p.yaml")


def args_for(text: str, model: str) -> EngineArgs:
    placement = parse_placement(text, "p.yaml")
    return EngineArgs(model, engine_process=True, placement=placement,
                      tensor_parallel_size=placement.engine_group.tensor_parallel_size)


@pytest.mark.parametrize("model, text, error", [
    ("tiny-orpheus", "groups:\n  - name: a\n  - name: b\n    nodes: [snac]\n",
     r"p.yaml:4: unknown node 'snac': orpheus models have backbone, snac_decoder"),
    ("tiny-whisper", "groups:\n  - name: a\n    nodes: [decoder]\n    devices: [3]\n",
     r"p.yaml:4: device cuda:3 is out of range: this machine has no GPU \(use cpu\)"),
    ("tiny-qwen3", "groups:\n  - name: a\n    devices: [cpu, cpu, cpu]\n",
     r"p.yaml:3: tensor parallel size 3 does not divide num_heads \(4\)"),
    ("tiny-orpheus", "groups:\n  - name: a\n    tensor_parallel_size: 2\n",
     r"p.yaml:3: tensor_parallel_size 2: orpheus models run on one device only"),
    ("tiny-orpheus", "groups:\n  - name: a\n  - name: b\n    nodes: [backbone]\n",
     r"p.yaml:4: node 'backbone' cannot run outside the engine's group yet \(orpheus: snac_decoder can\)"),
    ("tiny-orpheus", "groups:\n  - name: a\n  - name: b\n    nodes: [snac_decoder]\n    devices: [cpu, cpu]\n",
     r"p.yaml:5: group 'b': a worker group of several ranks does not run yet"),
    ("tiny-qwen3", "groups:\n  - name: a\n    devices: [cpu, cpu]\n  - name: b\n",
     r"p.yaml:4: group 'b': worker groups beside a tensor-parallel engine group do not run yet"),
])
def test_the_model_is_checked_before_its_weights_load(model, text, error):
    with pytest.raises(PlacementError, match=error):
        read_model(args_for(text, model))   # files only: the config says the nodes and the heads


def test_the_families_declare_the_nodes_their_graphs_have():
    """`ModelFamily.nodes` (read before loading) against the graphs the served models build."""
    from omniwalk.graph import LeftContext
    from omniwalk.models.decoder_lm.model import text_generation_graph
    from omniwalk.models.orpheus.model import orpheus_graph
    from omniwalk.models.qwen3_omni.model import thinker_graph
    from omniwalk.models.registry import FAMILIES
    from omniwalk.models.whisper.model import whisper_graph

    chunks = LeftContext(16, 4)
    graphs = {"qwen3": text_generation_graph, "llama": text_generation_graph, "qwen3_5": text_generation_graph,
              "orpheus": orpheus_graph, "whisper": whisper_graph,
              "qwen3-omni": lambda: thinker_graph(speaks=True, code2wav_chunks=chunks)}
    for name, graph in graphs.items():
        config = read_model(EngineArgs(f"tiny-{name}")).config
        assert {node.name: node for node in FAMILIES[name].nodes(config)} == graph().nodes, name


def test_a_placement_with_workers_needs_the_engine_process():
    with pytest.raises(ValueError, match="needs the engine process"):
        EngineArgs("tiny-orpheus", placement=load_placement(ORPHEUS_SPLIT))
    with pytest.raises(ValueError, match="tensor_parallel_size 1 but the placement's group 'a' has "
                                         "tensor_parallel_size 2"):
        EngineArgs("tiny-qwen3", engine_process=True, placement=parse_placement("groups: [{name: a, "
                                                                                "devices: [cpu, cpu]}]"))


def test_a_ray_address_needs_worker_groups_the_engine_process_and_ray(monkeypatch, tmp_path, capsys):
    """--ray-address is checked at the edge, without importing Ray (find_spec): it runs a
    placement's worker groups (tests/distributed/test_ray_workers.py runs them)."""
    split = load_placement(ORPHEUS_SPLIT)
    assert EngineArgs("tiny-orpheus", engine_process=True, placement=split, ray_address="auto").ray_address == "auto"
    with pytest.raises(ValueError, match="--ray-address runs a placement's worker groups as Ray actors: it needs "
                                         "--placement FILE with a group besides the engine's"):
        EngineArgs("tiny-orpheus", engine_process=True, ray_address="auto")
    with pytest.raises(ValueError, match="needs --placement FILE with a group besides"):
        EngineArgs("tiny-orpheus", engine_process=True, ray_address="auto",
                   placement=parse_placement("groups: [{name: a}]"))
    with pytest.raises(ValueError, match="a placement with worker groups needs the engine process"):
        EngineArgs("tiny-orpheus", engine_process=False, placement=split, ray_address="auto")
    with pytest.raises(ValueError, match="--ray-address is empty"):
        EngineArgs("tiny-orpheus", engine_process=True, placement=split, ray_address=" ")
    with monkeypatch.context() as patch:
        import importlib.util

        find_spec = importlib.util.find_spec
        patch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
        with pytest.raises(ValueError, match=r"--ray-address needs Ray, which is not installed: pip install "
                                             r"'omniwalk\[ray\]'"):
            EngineArgs("tiny-orpheus", engine_process=True, placement=split, ray_address="auto")
    assert main(["serve", "tiny-orpheus", "--ray-address", "auto", "--port", "0"]) == 2
    assert "omniwalk: error: --ray-address runs a placement's worker groups" in capsys.readouterr().err
    for command in (["bench"], ["generate", "tiny-orpheus", "hi"]):
        assert build_parser().parse_args([*command, "--ray-address", "10.0.0.1:6379"]).ray_address == "10.0.0.1:6379"
    # a worker group's GPUs are the cluster's, which Ray finds: not this machine's (it has none)
    on_gpus = "groups:\n  - name: a\n  - name: b\n    nodes: [snac_decoder]\n    devices: [3]\n"
    read_model(EngineArgs("tiny-orpheus", engine_process=True, placement=parse_placement(on_gpus, "p.yaml"),
                          ray_address="auto"))
    with pytest.raises(PlacementError, match=r"p.yaml:5: device cuda:3 is out of range"):
        read_model(args_for(on_gpus, "tiny-orpheus"))


def test_the_flags_and_the_file_agree(tmp_path):
    path = tmp_path / "tp.yaml"
    path.write_text("groups:\n  - name: decoder\n    devices: [cpu, cpu]\n")

    def engine_args(*flags: str) -> EngineArgs:
        return _engine_args(build_parser().parse_args(["serve", *flags]))

    args = engine_args("--placement", str(path))   # the file's size: -tp is its shorthand
    assert (args.tensor_parallel_size, args.device, args.placement) == (2, "cpu", load_placement(path))
    assert engine_args("--placement", str(path), "-tp", "2").tensor_parallel_size == 2
    with pytest.raises(PlacementError, match=r"tp.yaml:2: --tensor-parallel-size 4 but group 'decoder' has "
                                             r"tensor_parallel_size 2"):
        engine_args("--placement", str(path), "-tp", "4")
    with pytest.raises(PlacementError, match=r"tp.yaml:3: --device cuda but group 'decoder' runs on cpu"):
        engine_args("--placement", str(path), "--device", "cuda")
    assert engine_args("-tp", "2").resolved_placement == Placement.default(2)
    with pytest.raises(PlacementError, match=r"missing.yaml: cannot read the placement file"):
        engine_args("--placement", str(tmp_path / "missing.yaml"))


def test_serve_and_bench_refuse_a_bad_file_with_its_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("groups:\n  - name: main\n  - name: codec\n    nodes: [snac]\n")
    assert main(["serve", "tiny-orpheus", "--placement", str(path), "--port", "0"]) == 2
    assert f"omniwalk: error: {path}:4: unknown node 'snac'" in capsys.readouterr().err
    assert build_parser().parse_args(["bench", "--placement", str(path)]).placement == str(path)
