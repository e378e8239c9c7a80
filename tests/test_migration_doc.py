"""docs/migrating-from-nxdt.md's key table is generated from the schema and the inert table
(`nxdt.config.migration`): it matches the code, and it covers every key NxDT's release configs
write, each with a status; none of them is a key nxdt does not accept."""

from __future__ import annotations

from conftest import REPO
from omegaconf import OmegaConf

from nxdt.config import inert, migration
from nxdt.config.load import compose
from nxdt.config.typed import to_typed
from nxdt.config.validate import check_not_supported

PAGE = REPO / "docs" / "migrating-from-nxdt.md"
RELEASE = REPO / "tests" / "nxdt_release"
STATUSES = ("built", "built, inert in some runs", "inert", "inert on ", "refused when ", "alias of ", "not a key")


def _table() -> dict[str, tuple[str, str, str]]:
    """key -> (where, status, what) as the committed page has them."""
    out = {}
    for line in migration.generated_block(PAGE.read_text(encoding="utf-8")).splitlines():
        if line.startswith("| `"):
            key, where, status, what = (c.strip() for c in line.strip("|").split(" | ", 3))
            out[key.strip("`")] = (where, status, what.rstrip(" |"))
    return out


def test_the_page_matches_the_code():
    committed = migration.generated_block(PAGE.read_text(encoding="utf-8"))
    assert committed == migration.key_table(migration.release_keys(RELEASE)), (
        f"docs/migrating-from-nxdt.md's key table is stale: rewrite it with `{migration.REWRITE}`")


def test_every_release_key_has_a_status():
    release = migration.release_keys(RELEASE)
    assert len(list(RELEASE.glob("*.yaml"))) == 24 and max(release.values()) == 24
    table = _table()
    missing = sorted(set(release) - set(table))
    assert not missing, f"release keys missing from the page: {missing}"
    for key in release:
        where, status, what = table[key]
        assert where.startswith(f"{release[key]}/24"), (key, where)
        assert status.startswith(STATUSES) and status != "not a key", (key, status)
        assert what, key


def test_nxdt_accepts_every_key_nxdt_writes():
    """Zero keys of NxDT's that nxdt does not accept: over the 24 configs and the overview."""
    keys = set(migration.release_keys(RELEASE)) | set(migration.overview_keys())
    refused = [k for k in sorted(keys) if migration.key_row(k)[0] == "not accepted"]
    assert not refused
    # and validation agrees: each config, as written, passes the schema's checks (unknown keys,
    # types, ranges) and has nothing refused as not supported yet
    for path in sorted(RELEASE.glob("*.yaml")):
        check_not_supported(to_typed(OmegaConf.to_container(
            compose(["--config-path", str(RELEASE), "--config-name", path.stem]), resolve=True)))


def test_statuses_come_from_the_tables():
    assert migration.key_row("model.fusions.flash_attention")[0] == "inert"
    assert migration.key_row("model.fusions.softmax")[0] == "inert on cpu, cuda, mps, neuron"
    assert migration.key_row("compiler_cache_url")[0] == "inert on cpu, cuda, mps"  # TorchNeuron reads it too
    assert migration.key_row("precision.master_weights")[0] == "built, inert in some runs"
    assert migration.key_row("model.optim.capturable")[0] == "inert on cpu, mps"
    status, what = migration.key_row("distributed_strategy.token_shuffle_group_size")
    assert status == "refused when > 1" and inert.NOT_SUPPORTED_YET[
        "distributed_strategy.token_shuffle_group_size"].why in what
    assert migration.key_row("model_alignment_strategy.dpo.max_prompt_length")[0] == (
        "alias of `model_alignment_strategy.dpo.max_dpo_prompt_length`")
    assert "[alias of max_dpo_prompt_length]" in inert.describe("model_alignment_strategy.dpo.max_prompt_length")
    assert "`ActivationMultiplyMLP` = `LlamaMLP`" in migration.key_row("model.activations_checkpoint_recompute")[1]
    assert migration.key_row("model.optim.sched.name")[0] == "built"
    assert migration.key_row("model.no_such_key")[0] == "not accepted"
    assert migration.key_row("model.optim.no_such_arg")[0] == "not accepted"
    assert migration.key_row("exp_manager.exp_log_dir")[0] == "not a key"


def test_a_stale_page_is_caught():
    text = PAGE.read_text(encoding="utf-8")
    table = migration.key_table(migration.release_keys(RELEASE))
    stale = migration.rewrite(text, table.replace("| inert |", "| built |", 1))
    assert migration.generated_block(stale) != table
    assert migration.rewrite(stale, table) == text
