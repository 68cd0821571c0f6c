"""handbook_lib.hardware: link and accelerator presets, their units, and lookups."""

import ast
from pathlib import Path

import pytest

from handbook_lib import hardware
from handbook_lib.hardware import ACCELERATORS, LINKS, Accelerator, Link, Node, get_accelerator, get_link


@pytest.mark.parametrize("name, per_direction", [
    ("nvlink4", 900e9 / 2),     # 900 GB/s bidirectional
    ("nvlink3", 600e9 / 2),     # 600 GB/s bidirectional
    ("pcie4", 32e9),
    ("pcie5", 64e9),
    ("ib-ndr400", 400e9 / 8),   # 400 Gb/s in bytes/s
    ("ib-hdr200", 200e9 / 8),
    ("100gbe", 100e9 / 8),
    ("25gbe", 25e9 / 8),
])
def test_link_bandwidth_is_bytes_per_second_per_direction(name, per_direction):
    assert get_link(name).bandwidth_bytes_per_s == per_direction


def test_link_presets_are_exactly_the_documented_ones():
    assert set(LINKS) == {"nvlink4", "nvlink3", "pcie4", "pcie5", "ib-ndr400", "ib-hdr200",
                          "100gbe", "25gbe"}


@pytest.mark.parametrize("name", sorted(LINKS))
def test_link_latency_is_microseconds_and_sourced(name):
    link = get_link(name)
    assert 1e-7 <= link.latency_s <= 1e-4  # between 0.1 us and 100 us: seconds, not us
    assert "typical" in link.source and "datasheet" in link.source


def test_latencies_order_nvlink_below_infiniband_below_ethernet():
    assert LINKS["nvlink4"].latency_s <= LINKS["ib-ndr400"].latency_s < LINKS["100gbe"].latency_s
    assert 10e-6 <= LINKS["25gbe"].latency_s <= 50e-6


@pytest.mark.parametrize("name, memory, bf16, fp32", [
    ("a100-40gb", 40 * 1000**3, 312 * 1000**4, 19.5 * 1000**4),
    ("a100-80gb", 80 * 1000**3, 312 * 1000**4, 19.5 * 1000**4),
    ("h100-80gb", 80 * 1000**3, 989 * 1000**4, 67 * 1000**4),
    ("h200-141gb", 141 * 1000**3, 989 * 1000**4, 67 * 1000**4),
    ("l4-24gb", 24 * 1000**3, 242 * 1000**4 / 2, 30.3 * 1000**4),  # 242 with sparsity, halved
])
def test_accelerator_datasheet_figures(name, memory, bf16, fp32):
    acc = get_accelerator(name)
    assert acc.memory_bytes == memory and isinstance(acc.memory_bytes, int)
    assert acc.peak_flops_bf16 == pytest.approx(bf16)
    assert acc.peak_flops_fp32 == pytest.approx(fp32)
    assert "datasheet" in acc.source


def test_h200_has_h100_compute_and_more_memory():
    h100, h200 = get_accelerator("h100-80gb"), get_accelerator("h200-141gb")
    assert (h200.peak_flops_bf16, h200.peak_flops_fp32) == (h100.peak_flops_bf16, h100.peak_flops_fp32)
    assert h200.memory_bytes > h100.memory_bytes


def test_cpu_entry_says_it_is_nominal():
    assert set(ACCELERATORS) == {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l4-24gb", "cpu"}
    assert "nominal" in get_accelerator("cpu").source


@pytest.mark.parametrize("lookup, presets", [(get_link, LINKS), (get_accelerator, ACCELERATORS)])
@pytest.mark.parametrize("bad", ["NVLink4", "h100", "", None])
def test_unknown_names_list_the_accepted_ones(lookup, presets, bad):
    with pytest.raises(ValueError, match="name must be one of") as info:
        lookup(bad)
    for accepted in presets:
        assert accepted in str(info.value)


def test_presets_are_frozen():
    with pytest.raises(AttributeError):
        get_link("nvlink4").bandwidth_bytes_per_s = 1.0


@pytest.mark.parametrize("kwargs, field", [
    ({"bandwidth_bytes_per_s": 0, "latency_s": 1e-6}, "bandwidth_bytes_per_s"),
    ({"bandwidth_bytes_per_s": 1e9, "latency_s": -1e-6}, "latency_s"),
])
def test_link_rejects_bad_figures(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Link(name="x", source="test", **kwargs)


def test_accelerator_rejects_bad_figures():
    with pytest.raises(ValueError, match="memory_bytes"):
        Accelerator("x", 0, 1e12, 1e12, "test")
    with pytest.raises(ValueError, match="peak_flops_bf16"):
        Accelerator("x", 10**9, -1.0, 1e12, "test")


def test_node_picks_the_link_a_group_crosses():
    node = Node(get_accelerator("h100-80gb"), 8, get_link("nvlink4"), get_link("ib-ndr400"))
    assert node.link_for(1) is node.intra_link and node.link_for(8) is node.intra_link
    assert node.link_for(9) is node.inter_link and node.link_for(64) is node.inter_link
    with pytest.raises(ValueError, match="group_size"):
        node.link_for(0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        Node(get_accelerator("h100-80gb"), 0, get_link("nvlink4"), get_link("ib-ndr400"))


def test_module_imports_no_torch():
    tree = ast.parse(Path(hardware.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.split(".")[0] == "torch"]
