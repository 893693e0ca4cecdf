import pytest

from omniwalk.graph import (
    BudgetSpec, FixedChunks, GraphError, Keep, Loop, ModelGraph, Node, Parallel, Sequential,
    StreamEdge, StreamSpec, ToClient, ToStream, Walk, compile_walk,
)
from omniwalk.graph.compiled import EnterLoop, LoopBack, RunNode

a = Node("a", ("x",), ("y",))
b = Node("b", ("y",), ("z",))


def test_valid_walk_compiles_with_loop_jumps():
    walk = Walk("w", ("x",), Sequential(a, Loop("l", Sequential(b, ToClient("z", "out")), carry={"z": "y"})))
    ModelGraph([walk], [StreamSpec("s")])
    program = compile_walk(walk).program
    assert isinstance(program[0], RunNode) and program[0].node is a
    assert program[1] == EnterLoop("l", exit_pc=5)
    assert program[4] == LoopBack("l", body_pc=2, carry=(("z", "y"),))


def test_input_nobody_produces_names_the_node():
    with pytest.raises(GraphError, match=r"node 'b' reads 'y', which no walk input or earlier node produces"):
        ModelGraph([Walk("w", ("x",), Sequential(b, ToClient("z", "out")))], [StreamSpec("s")])


def test_output_nobody_consumes_names_the_node():
    with pytest.raises(GraphError, match=r"output 'z' of node 'b' is consumed by nobody"):
        ModelGraph([Walk("w", ("x",), Sequential(a, b))], [StreamSpec("s")])


def test_cycle_outside_a_loop():
    c = Node("c", ("z",), ("y",))   # feeds b, which feeds c
    b2 = Node("b", ("y",), ("z",))
    with pytest.raises(GraphError, match=r"node 'b' reads 'y', which is only written after it: a cycle"):
        ModelGraph([Walk("w", ("x",), Sequential(b2, c, ToClient("y", "o")))], [StreamSpec("s")])


def test_parallel_branches_cannot_read_each_other():
    with pytest.raises(GraphError, match=r"node 'b' reads 'y', which is only written after it"):
        ModelGraph([Walk("w", ("x",), Sequential(Parallel(b, a), ToClient("z", "o")))], [StreamSpec("s")])


def test_duplicate_node_name_with_different_ports():
    other_a = Node("a", ("x",), ("q",))
    walks = [Walk("w1", ("x",), Sequential(a, ToClient("y", "o"))),
             Walk("w2", ("x",), Sequential(other_a, ToClient("q", "o")))]
    with pytest.raises(GraphError, match=r"duplicate node name 'a'"):
        ModelGraph(walks, [StreamSpec("s")])


def test_duplicate_walk_loop_and_stream_names():
    walk = Walk("w", ("x",), Sequential(a, ToClient("y", "o")))
    with pytest.raises(GraphError, match=r"duplicate walk name 'w'"):
        ModelGraph([walk, walk], [StreamSpec("s")])
    with pytest.raises(GraphError, match=r"duplicate stream name 's'"):
        ModelGraph([walk], [StreamSpec("s"), StreamSpec("s")])
    loops = Walk("w", ("x",), Sequential(
        Loop("l", Sequential(a, ToClient("y", "o")), carry={"y": "x"}),
        Loop("l", Sequential(a, ToClient("y", "o")), carry={"y": "x"})))
    with pytest.raises(GraphError, match=r"duplicate loop name 'l'"):
        ModelGraph([loops], [StreamSpec("s")])


def test_two_nodes_writing_one_value():
    a2 = Node("a2", ("x",), ("y",))
    with pytest.raises(GraphError, match=r"node 'a2' writes 'y', already written by node 'a'"):
        ModelGraph([Walk("w", ("x",), Sequential(a, a2, ToClient("y", "o")))], [StreamSpec("s")])


def test_loop_carry_must_be_written_and_available():
    with pytest.raises(GraphError, match=r"loop 'l' carries 'q', which its body never writes"):
        ModelGraph([Walk("w", ("x",), Loop("l", Sequential(a, ToClient("y", "o")), carry={"q": "x"}))],
                   [StreamSpec("s")])
    with pytest.raises(GraphError, match=r"loop 'l' carries into 'nope'"):
        ModelGraph([Walk("w", ("x",), Loop("l", Sequential(a, ToClient("y", "o")), carry={"y": "nope"}))],
                   [StreamSpec("s")])


def test_stream_push_needs_a_stream_edge_and_budgets_a_real_loop():
    walk = Walk("w", ("x",), Sequential(a, ToStream("y", "codec")))
    with pytest.raises(GraphError, match=r"pushes 'y' to stream 'codec', which no StreamEdge consumes"):
        ModelGraph([walk], [StreamSpec("s"), StreamSpec("codec")])
    ModelGraph([walk], [StreamSpec("s"), StreamSpec("codec")], [StreamEdge("s", "codec", FixedChunks(2))])
    with pytest.raises(GraphError, match=r"budgets loop 'decode', which no walk has"):
        ModelGraph([Walk("w", ("x",), Sequential(a, ToClient("y", "o")))],
                   [StreamSpec("s", BudgetSpec("y", "decode"))])


def test_edge_reading_a_missing_value():
    with pytest.raises(GraphError, match=r"edge Keep\('nope'\) reads 'nope'"):
        ModelGraph([Walk("w", ("x",), Sequential(a, ToClient("y", "o"), Keep("nope")))], [StreamSpec("s")])


def test_budgeted_value_must_be_counted_before_it_is_pushed():
    lm = Node("lm", ("x",), ("code",))
    edges = [StreamEdge("codes", "audio", FixedChunks(2))]
    streams = [StreamSpec("codes", BudgetSpec("code", "decode")), StreamSpec("audio")]

    def walks(*elements):
        return [Walk("decode", ("x",), Loop("decode", Sequential(lm, *elements), carry={"code": "x"}))]

    with pytest.raises(GraphError, match=r"pushes budgeted 'code' to stream 'audio' before its ToClient"):
        ModelGraph(walks(ToStream("code", "audio"), ToClient("code", "codes")), streams, edges)
    ModelGraph(walks(ToClient("code", "codes"), ToStream("code", "audio")), streams, edges)
