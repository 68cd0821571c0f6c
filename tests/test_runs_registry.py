"""handbook_lib.runs: the runs described from their source, without importing torch."""


from handbook_lib.core.config import RunConfig
from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.runs import available_runs, describe_runs, run_config_fields


def test_every_run_is_described_by_its_docstring():
    described = describe_runs()
    assert sorted(described) == available_runs()
    assert {"tensor_parallel", "sequence_parallel", "fsdp_train"} <= set(described)
    assert all(line for line in described.values())


def test_a_config_class_imported_from_the_vocabulary_is_read_from_its_module():
    """Chapter 9's runs take core.parallel_config.ParallelConfig: its keys, as declared there,
    with the accepted values of its Literal aliases (SpMethod, PpSchedule)."""
    own = [key for key in ParallelConfig.keys() if key not in RunConfig.keys()]
    assert own == [key for key in ParallelConfig.sections()["layout"] if key not in RunConfig.keys()]
    for run in ("tensor_parallel", "sequence_parallel"):
        info = run_config_fields(run)
        assert (info.class_name, info.base) == ("ParallelConfig", "RunConfig")
        assert [key for key, _ in info.fields] == own
        assert info.choices == {"sp_method": ("ulysses", "ring"), "schedule": ("GPipe", "1F1B", "Interleaved1F1B",
                                                                          "ZBVZeroBubble")}
    assert run_config_fields("fsdp_train").fields == ()  # RunConfig itself: nothing added
