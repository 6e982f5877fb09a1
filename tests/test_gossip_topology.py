"""Graphs and mixing matrices (SPEC 1)."""
import math

import numpy as np
import pytest
import torch

from lp_decentral_nlp.gossip import GossipConfig, Topology, build_topology, make_topology

ALL = [("directed_ring", 8, {}), ("ring", 8, {}), ("torus", 16, {"rows": 4, "cols": 4}),
       ("exponential", 8, {}), ("complete", 5, {}), ("directed_ring", 1, {}), ("ring", 2, {}),
       ("torus", 6, {"rows": 2, "cols": 3}), ("exponential", 5, {})]


@pytest.mark.parametrize("name,n,kw", ALL)
def test_every_topology_is_column_stochastic_with_self_loops_at_several_steps(name, n, kw):
    topo = make_topology(name, n, **kw)
    for step in range(7):
        W = topo.mixing_matrix(step)
        assert W.shape == (n, n) and W.dtype == torch.float64
        assert torch.all(W >= 0)
        torch.testing.assert_close(W.sum(0), torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-12)
        assert torch.all(torch.diagonal(W) > 0)
        for i in range(n):
            outs = topo.out_neighbors(i, step)
            # default mixing: a node splits equally over itself and its out-neighbours
            expected = torch.zeros(n, dtype=torch.float64)
            expected[[i, *outs]] = 1.0 / (len(outs) + 1)
            torch.testing.assert_close(W[:, i], expected)
            assert topo.in_neighbors(i, step) == [j for j in range(n) if j != i and W[i, j] > 0]


def test_spectral_gap_of_8_node_directed_ring_is_one_minus_cos_pi_over_8():
    # W = (I + P) / 2: eigenvalues (1 + e^{2 pi i k / 8}) / 2, second modulus |cos(pi / 8)|
    assert make_topology("directed_ring", 8).spectral_gap() == pytest.approx(1 - math.cos(math.pi / 8), abs=1e-12)


def test_spectral_gaps_of_ring_torus_complete_match_their_eigenvalues():
    # ring, 1/3 each: (1 + 2 cos(2 pi k / n)) / 3; torus 4x4, 1/5 each: (1 + 2cos a + 2cos b) / 5
    assert make_topology("ring", 8).spectral_gap() == pytest.approx(1 - (1 + 2 * math.cos(math.pi / 4)) / 3)
    assert make_topology("torus", 16, rows=4, cols=4).spectral_gap() == pytest.approx(1 - 3 / 5)
    assert make_topology("complete", 6).spectral_gap() == pytest.approx(1.0)


def test_exponential_graph_cycles_hops_and_averages_exactly_over_one_period():
    topo = make_topology("exponential", 8)
    assert topo.period == 3
    assert [topo.out_neighbors(0, t) for t in range(4)] == [[1], [2], [4], [1]]
    assert [topo.in_neighbors(0, t) for t in range(3)] == [[7], [6], [4]]
    prod = topo.mixing_matrix(2) @ topo.mixing_matrix(1) @ topo.mixing_matrix(0)
    torch.testing.assert_close(prod, torch.full((8, 8), 1 / 8, dtype=torch.float64))
    assert topo.spectral_gap(1) == pytest.approx(0.0, abs=1e-12)  # one step alone is disconnected
    assert topo.period_spectral_gap() == pytest.approx(1.0)


def test_a_disconnected_steps_gap_is_zero_not_a_rounding_below_it():
    """|lambda_2| of the 6-node exponential graph's second step rounds to 1 + 2e-16: the gap was -2.2e-16."""
    assert all(make_topology("exponential", n).spectral_gap(t) >= 0.0 for n in (6, 12) for t in range(4))
    assert make_topology("exponential", 6).spectral_gap(1) == 0.0


def test_torus_neighbours():
    topo = make_topology("torus", 16, rows=4, cols=4)
    assert topo.out_neighbors(5) == [1, 4, 6, 9]
    assert topo.in_neighbors(0) == [1, 3, 4, 12]


def test_from_matrix_accepts_a_valid_directed_graph_and_a_time_varying_list():
    W = torch.tensor([[0.5, 0.0, 1 / 3], [0.5, 0.5, 0.0], [0.0, 0.5, 2 / 3]])
    topo = Topology.from_matrix(W)
    assert topo.num_nodes == 3 and topo.out_neighbors(0) == [1] and topo.in_neighbors(0) == [2]
    torch.testing.assert_close(topo.mixing_matrix(5), W.double())
    nested = Topology.from_matrix([[0.75, 0.5], [0.25, 0.5]])  # plain nested lists are one matrix
    assert nested.period == 1 and nested.weight(0, 1) == 0.5
    a = np.array([[0.5, 0.0], [0.5, 1.0]])
    tv = Topology.from_matrix([a, a[::-1, ::-1].copy()])  # each step one-way, union strongly connected
    assert tv.period == 2 and tv.out_neighbors(0, 0) == [1] and tv.out_neighbors(1, 1) == [0]


@pytest.mark.parametrize("W,message", [
    (np.ones((2, 3)) / 2, "square"),
    (np.array([[1.5, 0.5], [-0.5, 0.5]]), "nonnegative"),
    (np.array([[0.5, 0.5], [0.5, 0.4]]), r"column 1 sums to 0.9$"),  # a plain number, not np.float64(0.9)
    (np.array([[0.0, 0.5], [1.0, 0.5]]), "self-loop"),
    (np.array([[1.0, 0.5], [0.0, 0.5]]), "strongly connected"),
    (np.eye(3), "strongly connected"),
    (np.array([[np.nan, 0.5], [0.5, 0.5]]), "finite"),
    ([["a", "b"], ["c", "d"]], r"^matrices\[0\]: a mixing matrix must hold numbers"),
    # the imaginary parts were dropped with numpy's ComplexWarning
    ([[0.5 + 1j, 0.5], [0.5, 0.5]], r"^matrices\[0\]: a mixing matrix must hold real numbers, got complex ones$"),
    (torch.full((2, 2), 0.5, dtype=torch.complex64), r"^matrices\[0\]: a mixing matrix must hold real numbers, got "
                                                     r"torch.complex64$"),
])
def test_from_matrix_rejects_invalid_matrices_with_clear_errors(W, message):
    with pytest.raises(ValueError, match=message):
        Topology.from_matrix(W)


def test_a_torus_without_a_shape_is_the_most_square_one_and_one_side_fixes_the_other():
    """As GossipConfig's torus (``torus_rows=None``): make_topology needed both sides."""
    assert make_topology("torus", 12).name == "torus(3x4)"
    with pytest.warns(UserWarning, match=r"^a torus of 7 nodes is 1 x 7, the ring \(7 is prime\)"):
        assert make_topology("torus", 7).name == "torus(1x7)"
    assert make_topology("torus", 12, rows=2).name == "torus(2x6)"
    assert make_topology("torus", 12, cols=2).name == "torus(6x2)"
    assert build_topology(GossipConfig(num_nodes=12, topology="torus")).name == "torus(3x4)"


def test_make_topology_rejects_bad_arguments():
    with pytest.raises(ValueError, match="name must be one of"):
        make_topology("star", 4)
    with pytest.raises(ValueError, match="num_nodes"):
        make_topology("ring", 0)
    with pytest.raises(ValueError, match="^rows=3 does not divide num_nodes=16"):
        make_topology("torus", 16, rows=3)
    with pytest.raises(ValueError, match="rows \\* cols"):
        make_topology("torus", 16, rows=3, cols=5)
    with pytest.raises(ValueError, match="^rows must be an integer >= 1, got True"):
        make_topology("torus", 1, rows=True, cols=1)
    with pytest.raises(ValueError, match="only apply to name='torus'"):
        make_topology("ring", 4, rows=2)
    with pytest.raises(ValueError, match="step"):
        make_topology("ring", 4).mixing_matrix(-1)
    with pytest.raises(ValueError, match="node index"):
        make_topology("ring", 4).out_neighbors(4)


@pytest.mark.parametrize("W, name, message", [
    (None, "custom", r"^matrices must be an \(n, n\) array-like .* or a list of them, got NoneType$"),  # was "has no len()"
    (1.0, "custom", r"^matrices must be .*, got float$"),
    (np.full((2, 2), 0.5), 5, r"^name must be a str, got int$"),
])
def test_from_matrix_names_an_argument_of_the_wrong_type(W, name, message):
    with pytest.raises(TypeError, match=message):
        Topology.from_matrix(W, name=name)


def test_from_file_reads_a_graph_of_ones_own_from_npy_and_json(tmp_path):
    """A graph of one's own reaches the settings (and the recipes' --topology) as a file."""
    import json

    ring = make_topology("ring", 5)
    np.save(tmp_path / "ring.npy", ring.mixing_matrix().numpy())
    from_npy = Topology.from_file(tmp_path / "ring.npy")
    assert from_npy.name == "ring.npy" and from_npy.fingerprint() == ring.fingerprint()
    exponential = make_topology("exponential", 8)
    (tmp_path / "exp.json").write_text(json.dumps([exponential.mixing_matrix(t).tolist() for t in range(3)]))
    from_json = Topology.from_file(str(tmp_path / "exp.json"))
    assert from_json.period == 3 and from_json.fingerprint() == exponential.fingerprint()
    np.save(tmp_path / "stack.npy", np.stack([exponential.mixing_matrix(t).numpy() for t in range(3)]))
    assert Topology.from_file(tmp_path / "stack.npy").fingerprint() == exponential.fingerprint()


def test_from_file_names_the_file_it_cannot_use(tmp_path):
    (tmp_path / "cut.json").write_text("[[0.5, 0.5], [0.5")
    np.save(tmp_path / "half.npy", np.full((3, 3), 0.5))
    np.save(tmp_path / "objects.npy", np.array([{"W": 1}], dtype=object))  # a pickle is never loaded
    (tmp_path / "graph.txt").write_text("1")
    (tmp_path / "empty.npy").write_bytes(b"")  # numpy's EOFError was a traceback
    (tmp_path / "text.npy").write_text("0.5 0.5\n0.5 0.5\n")  # numpy offered to load it as a pickle, unsafely
    np.save(tmp_path / "row.npy", np.full(4, 0.25))
    for name, message in (("cut.json", r"cannot read it \(Expecting"),
                          ("empty.npy", r"cannot read it \(No data left in file\)"),
                          ("text.npy", r"cannot read it \(not a \.npy file \(numpy\.save writes one\)\)"),
                          ("row.npy", r"holds an array of shape \(4,\); a graph is a mixing matrix \(n, n\)"),
                          ("half.npy", r"matrices\[0\]: must be column stochastic .* column 0 sums to 1\.5"),
                          ("objects.npy", r"cannot read it \(Object arrays cannot be loaded when allow_pickle=False\)"),
                          ("graph.txt", r"a file of mixing matrices ends in \.npy or \.json"),
                          ("missing.npy", r"cannot read it \(\[Errno 2\] No such file")):
        with pytest.raises(ValueError, match=rf"^topology file '{tmp_path / name}': {message}"):
            Topology.from_file(tmp_path / name)
