"""Start-up checks and tensor-parallel sharding, without vLLM."""

from __future__ import annotations

import pytest

from oscar_kernels.serving import window_bytes_per_slot
from oscar_math.artifact import identity_rotations, save_rotations
from oscar_math.errors import OscarError
from oscar_vllm import compat
from oscar_vllm.settings import OscarSettings, default_max_num_seqs, load_checked, settings_from


def _artifact(tmp_path, layers=2, kv=4, d=32, granularity="kv_head", name="a.safetensors"):
    rot = identity_rotations("tiny", layers, kv, d, granularity=granularity)
    return str(save_rotations(tmp_path / name, rot))


def test_settings_from_additional_config_and_env(monkeypatch):
    monkeypatch.delenv("OSCAR_ROTATIONS", raising=False)
    assert settings_from({"oscar": {"rotations": "r.st"}}).rotations == "r.st"
    with pytest.raises(OscarError, match="needs a rotations artifact"):
        settings_from(None)
    monkeypatch.setenv("OSCAR_ROTATIONS", "/x/env.st")
    assert settings_from({}).rotations == "/x/env.st"
    assert settings_from({"oscar": {"rotations": "cfg.st"}}).rotations == "cfg.st"  # config wins
    with pytest.raises(OscarError, match="unknown keys"):
        settings_from({"oscar": {"rotation": "typo"}})


def test_exclude_layers_are_checked(tmp_path):
    def excl(value):
        return settings_from({"oscar": {"rotations": "r", "exclude_layers": value}}).exclude_layers

    assert excl([5, 0, 29]) == (0, 5, 29) and excl([]) == ()
    for bad in ("3", 3, [1.0], ["0"], [True], None):
        with pytest.raises(OscarError, match=r"must be a list of layer indices \(ints\)"):
            excl(bad)
    with pytest.raises(OscarError, match=r"lists layers \[3\] more than once"):
        excl([3, 1, 3])
    good = _artifact(tmp_path)  # 2 layers
    assert load_checked(OscarSettings(good, exclude_layers=(0, 1)), 2, 4, 32).num_layers == 2
    for bad in ((2,), (-1,), (0, 7)):
        with pytest.raises(OscarError, match=r"not layers of this model \(it has layers 0\.\.1\)") as e:
            load_checked(OscarSettings(good, exclude_layers=bad), 2, 4, 32)
        assert "\n" not in str(e.value)


def test_load_checked_rejects_bad_artifacts(tmp_path):
    good = _artifact(tmp_path)
    assert load_checked(OscarSettings(good), 2, 4, 32).num_layers == 2
    with pytest.raises(OscarError, match="not found"):
        load_checked(OscarSettings(str(tmp_path / "missing.safetensors")), 2, 4, 32)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(OscarError, match="corrupt.safetensors"):
        load_checked(OscarSettings(str(corrupt)), 2, 4, 32)
    for geometry, field in (
        ((3, 4, 32), "num_layers"),
        ((2, 8, 32), "num_kv_heads"),
        ((2, 4, 64), "head_dim"),
    ):
        with pytest.raises(OscarError, match=f"{field} mismatch"):
            load_checked(OscarSettings(good), *geometry)
    with pytest.raises(OscarError, match="multiple of 16"):
        load_checked(OscarSettings(good), 2, 4, 40)


def test_version_range():
    assert compat.version_supported("0.32.0") and compat.version_supported("0.33.1")
    assert compat.version_supported("0.32.0+cpu")
    for v in ("0.31.9", "0.34.0", "1.0.0", "", "dev"):
        assert not compat.version_supported(v)


def test_version_error_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.31.0")
    with pytest.raises(
        OscarError, match=r"supports vLLM >=0\.32,<0\.34; this environment has vLLM 0\.31\.0"
    ) as e:
        compat.check_version()
    assert "\n" not in str(e.value)


def test_layer_index():
    assert compat.layer_index("model.layers.7.self_attn.attn") == 7
    assert compat.layer_index("language_model.model.layers.12.self_attn.attn") == 12
    with pytest.raises(OscarError):
        compat.layer_index("attn")


def test_prefix_caching_must_be_off_where_the_guard_cannot_hook(monkeypatch):
    from types import SimpleNamespace

    on = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True))
    off = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=False))
    monkeypatch.setattr(compat, "guard_possible", lambda: False)
    with pytest.raises(OscarError, match="--no-enable-prefix-caching"):
        compat.check_prefix_caching(on)
    compat.check_prefix_caching(off)
    compat.guard_prefix_caching()  # logs, never raises (it runs in every process, OSCAR or not)
    monkeypatch.setattr(compat, "guard_possible", lambda: True)
    compat.check_prefix_caching(on)


def test_exact_prefix_caching_where_every_layer_is_int2_and_the_hybrid_manager_is_on(monkeypatch):
    from types import SimpleNamespace

    def cfg(caching=True, hybrid=True, extra=None, backend="OSCAR"):
        return SimpleNamespace(
            attention_config=SimpleNamespace(backend=SimpleNamespace(name=backend)),
            cache_config=SimpleNamespace(enable_prefix_caching=caching),
            scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=not hybrid),
            additional_config={"oscar": {"rotations": "r.safetensors", **(extra or {})}},
        )

    assert compat.exact_prefix_caching(cfg())
    assert not compat.exact_prefix_caching(cfg(caching=False))
    assert not compat.exact_prefix_caching(cfg(hybrid=False))  # window groups need the hybrid manager
    assert not compat.exact_prefix_caching(cfg(extra={"exclude_layers": [3]}))  # BF16 pages: not exact
    assert not compat.exact_prefix_caching(cfg(backend="CPU_ATTN"))
    # no start-up error where OSCAR serves caching itself, even if the guard could not hook
    monkeypatch.setattr(compat, "guard_possible", lambda: False)
    compat.check_prefix_caching(cfg())
    with pytest.raises(OscarError, match="--no-enable-prefix-caching"):
        compat.check_prefix_caching(cfg(extra={"exclude_layers": [3]}))
    # window blocks are cached densely unless a user chose an interval
    cc = SimpleNamespace(prefix_cache_retention_interval=0)
    compat._dense_window_checkpoints(cc)
    assert cc.prefix_cache_retention_interval is None
    cc = SimpleNamespace(prefix_cache_retention_interval=1024)
    compat._dense_window_checkpoints(cc)
    assert cc.prefix_cache_retention_interval == 1024


def test_window_records_mode_is_transient_where_slots_are_never_lost_unless_chosen(monkeypatch):
    from types import SimpleNamespace

    def cfg(v2, records=None, caching=True):
        extra = {} if records is None else {"window_records": records}
        return SimpleNamespace(
            attention_config=SimpleNamespace(backend=SimpleNamespace(name="OSCAR")),
            cache_config=SimpleNamespace(enable_prefix_caching=caching),
            scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
            additional_config={"oscar": {"rotations": "r.safetensors", **extra}},
            use_v2_model_runner=v2,
        )

    # auto: transient where a running request's window slot is never lost: its persistent V2 row,
    # or on V1 its request id's slot (the runner hook); held only where the hook is impossible
    monkeypatch.setattr(compat, "track_v1_requests", lambda *a: True)
    assert compat.window_records_mode(cfg(v2=True)) == "transient"
    assert compat.window_records_mode(cfg(v2=False)) == "transient"
    monkeypatch.setattr(compat, "track_v1_requests", lambda *a: False)
    assert compat.window_records_mode(cfg(v2=True)) == "transient"
    assert compat.window_records_mode(cfg(v2=False)) == "held"
    assert compat.window_records_mode(cfg(v2=True, records="held")) == "held"
    assert compat.window_records_mode(cfg(v2=False, records="transient")) == "transient"
    assert compat.window_records_mode(cfg(v2=True, caching=False)) is None
    with pytest.raises(OscarError, match="window_records"):
        settings_from({"oscar": {"rotations": "r", "window_records": "sometimes"}})


# ---- OSCAR's max_num_seqs default: windows per slot, a share of the device --------------------


def test_window_bytes_per_slot_counts_k_and_v_sink_and_recent_rows_of_every_int2_layer():
    # Qwen3-8B: 36 layers x 8 KV heads x (64 + 256) rows x (K, V) x 128 x 2 bytes = 45 MiB
    assert window_bytes_per_slot(36, 8, 128, 64, 256) == 36 * 8 * 320 * 2 * 128 * 2 == 47_185_920
    assert window_bytes_per_slot(33, 8, 128, 64, 256) < window_bytes_per_slot(36, 8, 128, 64, 256)


def test_default_max_num_seqs_fits_the_windows_in_a_share_of_the_device():
    h200, slot = 150_754_820_096, window_bytes_per_slot(36, 8, 128, 64, 256)
    n = default_max_num_seqs(1024, h200, slot)
    assert n == int(0.08 * h200) // slot == 255  # (127 at the 4 % vLLM 0.33 logged on the H200)
    assert n * slot <= 0.08 * h200 < (n + 1) * slot
    h100 = 81_559 * 2**20
    assert default_max_num_seqs(1024, h100, slot) == 144  # the H100's serving benchmark, 2026-12-07
    assert default_max_num_seqs(100, h200, slot) == 100  # never above the engine's default
    assert default_max_num_seqs(1024, 10 * slot, slot) == 16  # never below 16 ...
    assert default_max_num_seqs(8, 10 * slot, slot) == 8  # ... unless the engine's default is lower
    assert default_max_num_seqs(256, 0, slot) == 256  # device size unknown: the engine's default


class _Args:
    """Stands in for vLLM's EngineArgs: the method vLLM uses to fill in max_num_seqs."""

    def __init__(self, max_num_seqs, backend, rotations):
        self.max_num_seqs = max_num_seqs
        self.attention_backend = None
        self.attention_config = type("A", (), {"backend": backend})()
        self.additional_config = {"oscar": {"rotations": rotations}}

    def _set_default_max_num_seqs_and_batched_tokens_args(self, usage_context, model_config, parallel_config):
        if self.max_num_seqs is None:
            self.max_num_seqs = 1024


class _ModelConfig:
    hf_text_config = type("H", (), {"num_hidden_layers": 4})()

    def get_num_kv_heads(self, parallel_config):
        return 2

    def get_total_num_kv_heads(self):
        return 2

    def get_head_size(self):
        return 64


def test_oscar_engines_get_the_window_sized_default_and_a_users_value_is_kept(tmp_path, monkeypatch):
    path = str(save_rotations(tmp_path / "r.safetensors", identity_rotations("m", 4, 2, 64)))
    slot = window_bytes_per_slot(4, 2, 64, 64, 256)
    monkeypatch.setattr(compat, "_device_total_memory", lambda: 50 * slot * 25)  # 8 % = 100 slots
    cls = type("Args", (_Args,), {})
    compat.wrap_max_num_seqs_default(cls)
    compat.wrap_max_num_seqs_default(cls)  # idempotent: wrapped once

    def run(seqs, backend="OSCAR", rotations=path):
        a = cls(seqs, backend, rotations)
        a._set_default_max_num_seqs_and_batched_tokens_args(None, _ModelConfig(), None)
        return a.max_num_seqs

    assert run(None) == 100
    assert run(300) == 300  # the user's value
    assert run(None, backend="FLASH_ATTN") == 1024  # other backends: vLLM's default
    assert run(None, rotations=str(tmp_path / "missing.safetensors")) == 1024  # reported at start-up instead


# ---- OSCAR's block_size default on a GPU: 64-token pages for the decode kernel --------------------


class _ConfigArgs:
    """Stands in for vLLM's EngineArgs: ``create_engine_config`` builds the cache config from
    ``block_size`` (``None``: vLLM's default of 16)."""

    def __init__(self, block_size, backend):
        self.block_size = block_size
        self.attention_backend = None
        self.attention_config = type("A", (), {"backend": backend})()

    def create_engine_config(self, usage_context=None):
        return {"block_size": 16 if self.block_size is None else self.block_size}


def test_oscar_engines_on_a_gpu_get_64_token_blocks_and_a_users_value_is_kept():
    gpu = [True]
    cls = type("Args", (_ConfigArgs,), {})
    compat.wrap_block_size_default(cls, lambda: gpu[0])
    compat.wrap_block_size_default(cls, lambda: gpu[0])  # idempotent: wrapped once

    def run(block_size, backend="OSCAR"):
        return cls(block_size, backend).create_engine_config()["block_size"]

    assert run(None) == 64
    assert run(16) == 16  # the user's value, even vLLM's default given explicitly
    assert run(128) == 128
    assert run(None, backend="FLASH_ATTN") == 16  # other backends: vLLM's default
    gpu[0] = False
    assert run(None) == 16  # the CPU build: the kernels there take any page size at one speed
