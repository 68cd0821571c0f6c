"""handbook_lib.models.hardware: link and accelerator presets, their units, and lookups."""


import pytest

from handbook_lib.models import (
    ACCELERATORS,
    CUDA_CONTEXT_BYTES,
    TRAINING_CONTEXT_BYTES,
    LINKS,
    Accelerator,
    Host,
    Link,
    Node,
    datasheet_bytes,
    default_intra_link,
    get_accelerator,
    get_link,
    node_preset,
    usable_memory_bytes,
)


@pytest.mark.parametrize("name, per_direction", [
    ("nvlink4", 900e9 / 2),     # 900 GB/s bidirectional
    ("nvlink3", 600e9 / 2),     # 600 GB/s bidirectional
    ("pcie4", 32e9),
    ("pcie5", 64e9),
    ("ib-ndr400", 400e9 / 8),   # 400 Gb/s in bytes/s
    ("ib-hdr200", 200e9 / 8),
    ("100gbe", 100e9 / 8),
    ("25gbe", 25e9 / 8),
    ("nvlink5", 1.8e12 / 2),    # 1.8 TB/s bidirectional
    ("infinity-fabric", 896e9 / 2),  # 7 links x 128 GB/s bidirectional = 896 GB/s
    ("loopback", 1e9),          # nominal
])
def test_link_bandwidth_is_bytes_per_second_per_direction(name, per_direction):
    assert get_link(name).bandwidth_bytes_per_s == per_direction


def test_link_presets_are_exactly_the_documented_ones():
    assert set(LINKS) == {"nvlink4", "nvlink3", "pcie4", "pcie5", "ib-ndr400", "ib-hdr200",
                          "100gbe", "25gbe", "nvlink5", "infinity-fabric", "loopback"}


@pytest.mark.parametrize("name", sorted(LINKS))
def test_link_latency_is_microseconds_and_sourced(name):
    link = get_link(name)
    assert 1e-7 <= link.latency_s <= 1e-4  # between 0.1 us and 100 us: seconds, not us
    assert "datasheet" in link.source or "specification" in link.source or "line rate" in link.source
    assert "typical" in link.source or "fitted to NCCL's reduce-scatter" in link.source


def test_latencies_order_infiniband_below_ethernet_and_nvlinks_ring_step_is_fitted():
    assert LINKS["ib-ndr400"].latency_s < LINKS["100gbe"].latency_s
    assert 10e-6 <= LINKS["25gbe"].latency_s <= 50e-6
    # NVLink's is a whole ring step of NCCL's kernels, fitted on 8 H100 (the published page)
    assert LINKS["nvlink4"].latency_s == 7.7e-6 and "nccl#1047" in LINKS["nvlink4"].source


MIB, GIB = 2**20, 2**30


@pytest.mark.parametrize("name, memory, printed_gb, bf16, fp32", [
    ("a100-40gb", 40_960 * MIB, 40, 312 * 1000**4, 19.5 * 1000**4),  # nvidia-smi: 40960MiB
    ("a100-80gb", 81_920 * MIB, 80, 312 * 1000**4, 19.5 * 1000**4),  # nvidia-smi: 81920MiB
    ("h100-80gb", 81_559 * MIB, 80, 989 * 1000**4, 67 * 1000**4),  # nvidia-smi: 81559MiB
    ("h200-141gb", 143_771 * MIB, 141, 989 * 1000**4, 67 * 1000**4),  # nvidia-smi: 143771MiB
    ("l4-24gb", 24 * GIB, 24, 242 * 1000**4 / 2, 30.3 * 1000**4),  # 242 with sparsity, halved
    ("b200-180gb", 1440 * GIB // 8, 180, 36e15 / 8 / 2, 600e12 / 8),  # HGX/DGX B200 totals for 8 GPUs
    ("mi300x-192gb", 192 * GIB, 192, 1307.4e12, 163.4e12),  # as AMD states it (2614.9 with sparsity)
])
def test_accelerator_datasheet_figures(name, memory, printed_gb, bf16, fp32):
    acc = get_accelerator(name)
    assert acc.memory_bytes == memory and isinstance(acc.memory_bytes, int)
    # the datasheet's "80 GB" read as decimal, as the book read it before: about 7 % less
    assert datasheet_bytes(acc) == printed_gb * 10**9
    assert 1.06 < acc.memory_bytes / datasheet_bytes(acc) < 1.08
    assert acc.peak_flops_bf16 == pytest.approx(bf16)
    assert acc.peak_flops_fp32 == pytest.approx(fp32)
    assert "datasheet" in acc.source


def test_usable_memory_is_what_cuda_reports_less_a_training_process_context():
    h100 = get_accelerator("h100-80gb")
    assert CUDA_CONTEXT_BYTES == 287_047_680  # pytorch/pytorch#86509, lazy module loading (bare)
    assert TRAINING_CONTEXT_BYTES == 1_457_521_152  # measured on one H200 by make gpu-check
    # vllm-project/vllm#27508: "a total capacity of 79.11 GiB"; the context measured on the H200
    assert h100.runtime_memory_bytes == round(79.11 * 2**30)
    assert usable_memory_bytes(h100) == round(79.11 * 2**30) - 1_457_521_152
    # ArcInstitute/evo2#190: "a total capacity of 22.03 GiB" on an L4, less the same context
    assert usable_memory_bytes("l4-24gb") == round(22.03 * 2**30) - 1_457_521_152
    assert usable_memory_bytes("cpu") == get_accelerator("cpu").memory_bytes  # no CUDA context


def test_the_h200_budget_is_the_usable_memory_gpu_check_measured():
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "results" / "gpu" / "nvidia-h200.json"
    sweep = json.loads(path.read_text())["max_micro_batch"]
    h200 = get_accelerator("h200-141gb")
    assert h200.runtime_memory_bytes == sweep["device_memory_bytes"]
    assert usable_memory_bytes(h200) == sweep["capacity_bytes"]   # free + reserve - workspaces
    # the driver's share: nvidia-smi lists 616 MiB "Reserved" (results/gpu/nvidia-h200-machine.txt)
    assert abs(h200.memory_bytes - h200.runtime_memory_bytes - 616 * MIB) < MIB


def test_every_runtime_total_is_sourced_and_below_the_cards_total():
    from handbook_lib.models.hardware import ACCELERATORS, RUNTIME_MEMORY_SOURCES

    with_total = {k for k, a in ACCELERATORS.items() if a.runtime_memory_bytes is not None}
    assert with_total == set(RUNTIME_MEMORY_SOURCES) == {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb",
                                                         "l4-24gb"}
    for key in with_total:
        acc = ACCELERATORS[key]
        # the HBM cards keep back under 2 %; the L4, a GDDR6 card, 8 % (22.03 of 24 GiB)
        kept = 0.91 if key == "l4-24gb" else 0.98
        assert kept * acc.memory_bytes < acc.runtime_memory_bytes < acc.memory_bytes, key


@pytest.mark.parametrize("name, cpu, cores, link", [
    ("a100-80gb", "AMD EPYC 7742", 128, "pcie4"),
    ("h100-80gb", "Xeon Platinum 8480C", 112, "pcie5"),
    ("h200-141gb", "Xeon Platinum 8480C", 112, "pcie5"),
    ("b200-180gb", "Xeon Platinum 8570", 112, "pcie5"),
    ("l4-24gb", "g2-standard-96", 48, "pcie4"),
])
def test_hosts_come_from_the_servers_datasheets(name, cpu, cores, link):
    host = get_accelerator(name).host
    assert host is not None and cpu in host.name and host.cores == cores and host.link == link
    assert host.memory_bytes >= 384 * 10**9 and host.source


def test_a_platform_without_a_named_host_has_none():
    assert get_accelerator("mi300x-192gb").host is None


def test_host_and_context_are_checked():
    with pytest.raises(ValueError, match="cores"):
        Host("x", 0, 10**9, "pcie4", "s")
    with pytest.raises(ValueError, match="host link of 'x' must be one of"):
        Host("x", 8, 10**9, "usb", "s")
    with pytest.raises(ValueError, match="context_bytes of 'x' must be less than the memory CUDA reports"):
        Accelerator("x", 1000, 1.0, 1.0, "s", context_bytes=1000)
    with pytest.raises(ValueError, match="context_bytes of 'x' must be less than the memory CUDA reports"):
        Accelerator("x", 1000, 1.0, 1.0, "s", context_bytes=900, runtime_memory_bytes=900)
    with pytest.raises(ValueError, match=r"runtime_memory_bytes of 'x' must be an int in \(0, memory_bytes\]"):
        Accelerator("x", 1000, 1.0, 1.0, "s", context_bytes=0, runtime_memory_bytes=1001)
    with pytest.raises(ValueError, match="datasheet_gb"):
        Accelerator("x", 10**10, 1.0, 1.0, "s", datasheet_gb=0)


def test_h200_has_h100_compute_and_more_memory():
    h100, h200 = get_accelerator("h100-80gb"), get_accelerator("h200-141gb")
    assert (h200.peak_flops_bf16, h200.peak_flops_fp32) == (h100.peak_flops_bf16, h100.peak_flops_fp32)
    assert h200.memory_bytes > h100.memory_bytes


def test_cpu_entry_says_it_is_nominal():
    assert set(ACCELERATORS) == {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l4-24gb",
                                 "b200-180gb", "mi300x-192gb", "cpu"}
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



# --- Nodes: every accelerator preset states its own intra-node link and node size. ---

@pytest.mark.parametrize("name", sorted(ACCELERATORS))
def test_every_accelerator_preset_states_its_node(name):
    acc = get_accelerator(name)
    assert acc.intra_link in LINKS, f"{name} states no known intra-node link"
    assert isinstance(acc.gpus_per_node, int) and acc.gpus_per_node >= 1
    assert acc.node_source  # the link and the node size are sourced, in words
    assert default_intra_link(name) is LINKS[acc.intra_link] is default_intra_link(acc)


@pytest.mark.parametrize("name, link", [
    ("a100-40gb", "nvlink3"), ("a100-80gb", "nvlink3"),    # as strategy's name matching did
    ("h100-80gb", "nvlink4"), ("h200-141gb", "nvlink4"),
    ("l4-24gb", "pcie4"),
    ("b200-180gb", "nvlink5"), ("mi300x-192gb", "infinity-fabric"),  # their own, not PCIe 4
])
def test_intra_link_of_each_gpu(name, link):
    assert default_intra_link(name) is LINKS[link]
    assert node_preset(name).intra_link is LINKS[link]


@pytest.mark.parametrize("name", ["b200-180gb", "mi300x-192gb"])
def test_new_gpus_do_not_fall_back_to_pcie(name):
    assert default_intra_link(name) is not LINKS["pcie4"]
    assert default_intra_link(name).bandwidth_bytes_per_s > LINKS["nvlink4"].bandwidth_bytes_per_s / 2


def test_usual_node_sizes():
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l4-24gb", "b200-180gb",
                 "mi300x-192gb"):
        assert get_accelerator(name).gpus_per_node == 8, name


def test_infinity_fabric_is_seven_links_each_way():
    # 7 peer links of 128 GB/s bidirectional each: 64 GB/s each way per link, 448 in all.
    assert LINKS["infinity-fabric"].bandwidth_bytes_per_s == 7 * 128e9 / 2 == 7 * 64e9


def test_node_preset_builds_a_node_that_picks_links():
    node = node_preset("h100-80gb")
    assert isinstance(node, Node) and node.accelerator is get_accelerator("h100-80gb")
    assert node.gpus_per_node == 8
    assert node.link_for(8) is LINKS["nvlink4"] and node.link_for(9) is LINKS["ib-ndr400"]
    b200 = node_preset(get_accelerator("b200-180gb"), inter_link=get_link("100gbe"), gpus_per_node=4)
    assert b200.gpus_per_node == 4
    assert b200.link_for(4) is LINKS["nvlink5"] and b200.link_for(5) is LINKS["100gbe"]
    assert node_preset("l4-24gb", inter_link="25gbe", intra_link="pcie5").link_for(2) is LINKS["pcie5"]


def test_node_preset_rejects_bad_arguments():
    with pytest.raises(ValueError, match="accelerator name must be one of"):
        node_preset("b200")
    with pytest.raises(ValueError, match="link name must be one of"):
        node_preset("h100-80gb", inter_link="ib-xdr")
    with pytest.raises(ValueError, match="gpus_per_node"):
        node_preset("h100-80gb", gpus_per_node=0)
    with pytest.raises(ValueError, match="accelerator name must be one of"):
        default_intra_link("tpu")


def test_accelerator_without_a_link_is_refused_not_given_pcie():
    mystery = Accelerator("Mystery GPU 64GB", 64 * 10**9, 1e15, 50e12, "test")  # old positional form
    assert mystery.intra_link == "" and mystery.gpus_per_node is None
    for call in (lambda: default_intra_link(mystery), lambda: node_preset(mystery)):
        with pytest.raises(ValueError, match="Mystery GPU 64GB") as info:
            call()
        assert "pass intra_link explicitly" in str(info.value)
    with pytest.raises(ValueError, match="Mystery GPU 64GB.*pass gpus_per_node explicitly"):
        node_preset(mystery, intra_link="pcie5")
    node = node_preset(mystery, intra_link="pcie5", gpus_per_node=4)
    assert node.link_for(4) is LINKS["pcie5"]


def test_accelerator_rejects_unknown_link_or_node_size():
    with pytest.raises(ValueError, match="intra_link") as info:
        Accelerator("x", 10**10, 1e12, 1e12, "test", "nvlink9", 8)
    assert "'nvlink9'" in str(info.value)
    for accepted in LINKS:
        assert accepted in str(info.value)
    for bad in (0, -8, True, 8.0):
        with pytest.raises(ValueError, match="gpus_per_node"):
            Accelerator("x", 10**10, 1e12, 1e12, "test", "nvlink4", bad)
    assert Accelerator("x", 10**10, 1e12, 1e12, "test", "nvlink4", 8).gpus_per_node == 8


@pytest.mark.parametrize("key", [k for k, a in ACCELERATORS.items() if a.memory_bandwidth_bytes_per_s])
def test_memory_bandwidth_is_the_one_its_source_states(key):
    # The figure and its source are typed separately; they must agree (GB/s or TB/s, 3-4 digits).
    acc = ACCELERATORS[key]
    bw = acc.memory_bandwidth_bytes_per_s
    stated = f"{bw / 1e12:g} TB/s" if bw >= 3e12 else f"{bw / 1e9:,.0f} GB/s"
    assert stated in acc.source


def test_hbm_is_several_times_faster_than_nvlink_one_way():
    # The seed's "all-gathers at memory speed on NVLink": H100 HBM3 against NVLink 4 one way.
    h100 = ACCELERATORS["h100-80gb"]
    ratio = h100.memory_bandwidth_bytes_per_s / LINKS[h100.intra_link].bandwidth_bytes_per_s
    assert 7 < ratio < 8


def test_memory_bandwidth_must_be_positive():
    with pytest.raises(ValueError, match="memory_bandwidth_bytes_per_s must be > 0 or None"):
        Accelerator("x", 10**10, 1.0, 1.0, "s", memory_bandwidth_bytes_per_s=0.0)
