"""scripts/build_tiny_code.py: the real stages at --quick size (tiny vocab, model, budget).

Runs in-process (one torch import) on 1 thread; CPU results are expected to be bit-identical.
"""
import importlib.util
import os
import subprocess
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # minutes here: scripts/run_tests.sh --fast leaves it out

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_tiny_code.py"
spec = importlib.util.spec_from_file_location("build_tiny_code", SCRIPT)
btc = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = btc  # dataclasses resolve string annotations through sys.modules
spec.loader.exec_module(btc)

QUICK = ["--quick", "--threads", "1", "--max-files", "12"]


def run(out, *extra):
    return btc.main([*QUICK, "--out", str(out), *extra])


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """One uninterrupted quick build, seed 0: the reference the other tests compare against."""
    out = tmp_path_factory.mktemp("ref")
    summary = run(out)
    return out, summary


def with_tokenizer(ref_out, dst):
    """A fresh out dir holding a copy of the reference tokenizer stage, so only `target` reruns."""
    shutil.copytree(ref_out / "tokenizer", dst / "tokenizer")
    return dst


def test_tokenizer_round_trips_and_has_specials(ref):
    from transformers import AutoConfig, AutoTokenizer
    out, summary = ref
    tok = AutoTokenizer.from_pretrained(out / "target")  # shipped next to the model
    cfg = AutoConfig.from_pretrained(out / "target")
    assert tok.eos_token == "<|endoftext|>" and tok.mask_token == "<|mask|>"
    assert tok.eos_token_id == cfg.eos_token_id == summary["tokenizer"]["eos_id"]
    assert 0 <= tok.mask_token_id < cfg.vocab_size and tok.mask_token_id != tok.eos_token_id
    assert len(tok) <= cfg.vocab_size and cfg.vocab_size % 64 == 0
    assert tok.chat_template is None
    split = json.loads((out / "tokenizer" / "split.json").read_text())
    held = (Path(split["stdlib"]) / split["heldout"][0]).read_text(encoding="utf-8")
    for text in [held, "def f(x):\n\treturn x ** 2  # ünïcode 🙂\r\n", "   \n\n  x=1"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
        assert tok.eos_token_id not in ids and tok.mask_token_id not in ids
    # split by file, disjoint; both token streams are documents each followed by <|endoftext|>
    assert split["heldout"] and not set(split["heldout"]) & set(split["train"])
    import numpy as np
    for part in ("train", "heldout"):
        arr = np.load(out / "tokenizer" / f"{part}.npy")
        assert arr[-1] == tok.eos_token_id and (arr == tok.eos_token_id).sum() == len(split[part])


def test_target_loads_and_is_trained(ref):
    from transformers import AutoModelForCausalLM
    out, summary = ref
    model = AutoModelForCausalLM.from_pretrained(out / "target")
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    assert model.config.tie_word_embeddings
    metrics = json.loads((out / "target" / "metrics.json").read_text())
    assert metrics == summary["target"]
    log = [json.loads(ln) for ln in (out / "target" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, btc.QUICK.steps + 1))
    assert log[-1]["loss"] < log[0]["loss"]  # a few steps from init already lower the loss
    assert metrics["heldout_ppl"] == pytest.approx(2.718281828 ** metrics["heldout_loss"])
    assert not (out / "target.work").exists() and not list(out.glob(".*.tmp"))


def test_same_seed_same_bytes_other_seed_differs(ref, tmp_path):
    out, _ = ref
    run(tmp_path / "a")
    for f in ["tokenizer/tokenizer.json", "tokenizer/train.npy", "target/model.safetensors"]:
        assert (tmp_path / "a" / f).read_bytes() == (out / f).read_bytes(), f
    run(tmp_path / "b", "--seed", "1")
    assert (tmp_path / "b/target/model.safetensors").read_bytes() != (out / "target/model.safetensors").read_bytes()


def test_resume_after_max_steps_is_bit_identical(ref, tmp_path):
    out, summary = ref
    dst = with_tokenizer(out, tmp_path)
    first = run(dst, "--max-steps", "3")
    assert first["target"] is None and not (dst / "target").exists()
    state = torch.load(dst / "target.work" / "ckpt.pt", weights_only=True)
    assert state["step"] == 3
    with open(dst / "target.work" / "train_log.jsonl", "a") as f:  # a killed run logged past its ckpt
        f.write(json.dumps({"step": 4, "loss": -1.0, "lr": 0.0}) + "\n")
    second = run(dst)
    assert second["target"]["fp32_sha256"] == summary["target"]["fp32_sha256"]
    assert second["target"]["heldout_loss"] == summary["target"]["heldout_loss"]
    assert (dst / "target/model.safetensors").read_bytes() == (out / "target/model.safetensors").read_bytes()
    logs = [[(r["step"], r["loss"], r["lr"]) for r in map(json.loads, (d / "target/train_log.jsonl").open())]
            for d in (dst, out)]
    assert logs[0] == logs[1]


def test_failed_checkpoint_write_keeps_previous(ref, tmp_path, monkeypatch):
    out, summary = ref
    dst = with_tokenizer(out, tmp_path)
    run(dst, "--max-steps", "2")
    ckpt = dst / "target.work" / "ckpt.pt"
    before = ckpt.read_bytes()

    def torn_save(obj, f, *a, **k):  # writes half a file, then the disk "fills up"
        f.write(b"half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="No space"):
        run(dst)  # resumes at 2, fails writing the step-4 checkpoint
    monkeypatch.undo()
    assert ckpt.read_bytes() == before and not list(ckpt.parent.glob("*.tmp"))
    assert not (dst / "target").exists()
    assert run(dst)["target"]["fp32_sha256"] == summary["target"]["fp32_sha256"]


def test_complete_stage_is_skipped_and_force_rebuilds(ref, tmp_path, capsys):
    out, summary = ref
    dst = tmp_path / "o"
    shutil.copytree(out, dst)
    mtime = (dst / "target/model.safetensors").stat().st_mtime_ns
    assert run(dst) == summary
    assert "skipped (complete)" in capsys.readouterr().out
    assert (dst / "target/model.safetensors").stat().st_mtime_ns == mtime
    run(dst, "--stages", "target", "--force")
    assert (dst / "target/model.safetensors").stat().st_mtime_ns != mtime


@pytest.mark.parametrize("argv, arg", [
    (["--threads", "0"], "--threads"),
    (["--stages", "tokenizer,drafter"], "--stages"),
    (["--stages", ","], "--stages"),
    (["--max-files", "1"], "--max-files"),
    (["--max-steps", "0"], "--max-steps"),
    (["--seed", "-1"], "--seed"),
    (["--seed", "x"], "--seed"),
    (["--device", "tpu"], "--device"),
])
def test_bad_arguments_name_the_argument(argv, arg, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        btc.main(["--out", str(tmp_path), *argv])
    assert e.value.code == 2 and f"argument {arg}" in capsys.readouterr().err


def test_bad_inputs_raise(ref, tmp_path):
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(SystemExit):  # --out is a file
        btc.main(["--out", str(afile)])
    with pytest.raises(SystemExit, match="run the tokenizer stage first"):
        run(tmp_path / "empty", "--stages", "target")
    dst = tmp_path / "o"
    shutil.copytree(ref[0] / "tokenizer", dst / "tokenizer")
    with pytest.raises(SystemExit, match="--force"):  # built with seed 0, asked for seed 1
        run(dst, "--stages", "tokenizer", "--seed", "1")


# ---------------------------------------------------------------------------------------------
# stage `draft` (sglang_tev.train)

def test_draft_stage_loads_and_decodes_like_autoregressive(ref):
    from transformers import AutoTokenizer

    from sglang_tev.draft.dflash import DFlashDraftModel
    from sglang_tev.hf.runtime import SpeculativeGenerator
    out, summary = ref
    assert {"config.json", "model.safetensors", "metrics.json", "stage.json",
            "train_log.jsonl"} <= set(p.name for p in (out / "draft").iterdir())
    assert not (out / "draft_train").exists() and not list(out.glob(".*.tmp"))
    draft = DFlashDraftModel.from_pretrained(out / "draft")
    tok = AutoTokenizer.from_pretrained(out / "target")
    assert draft.fc.weight.dtype == torch.bfloat16 and draft.config.block_size == 16
    assert draft.config.mask_token_id == tok.mask_token_id == summary["tokenizer"]["mask_id"]
    assert list(draft.config.target_layer_ids) == list(btc.QUICK_DRAFT.target_layer_ids)
    metrics = json.loads((out / "draft" / "metrics.json").read_text())
    assert len(metrics["heldout_acc"]) == len(metrics["heldout_ce"]) == 15
    assert {k: v for k, v in metrics.items() if k != "heldout"} == summary["draft"]
    log = [json.loads(ln) for ln in (out / "draft" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, btc.QUICK_DRAFT.steps + 1))

    gen = SpeculativeGenerator.from_pretrained(out / "target", out / "draft", device="cpu")
    prompt = "def parse(line):\n    "
    want = gen.generate(prompt, method="autoregressive", max_new_tokens=20, ignore_eos=True).token_ids
    assert len(want) == 20
    for method in ("tev", "chain"):
        got = gen.generate(prompt, method=method, budget=8, max_new_tokens=20, ignore_eos=True)
        assert got.token_ids == want, method


def test_draft_stage_resumes_bit_identically(ref, tmp_path):
    out, summary = ref
    dst = with_tokenizer(out, tmp_path)
    shutil.copytree(out / "target", dst / "target")
    first = run(dst, "--stages", "draft", "--max-steps", "3")
    assert first["draft"] is None and not (dst / "draft").exists()
    assert (dst / "draft_train" / "checkpoints" / "step_00000003").is_dir()
    n = torch.get_num_threads()
    try:  # the trainer pins the thread count: CPU float results depend on it
        with pytest.raises(SystemExit, match="argument --threads"):
            btc.main(["--quick", "--threads", "2", "--max-files", "12", "--out", str(dst), "--stages", "draft"])
    finally:
        torch.set_num_threads(n)
    second = run(dst, "--stages", "draft")
    assert second["draft"] == summary["draft"] | {"wall_s": second["draft"]["wall_s"]}
    assert (dst / "draft/model.safetensors").read_bytes() == (out / "draft/model.safetensors").read_bytes()
    logs = [[{k: v for k, v in json.loads(ln).items() if k != "tokens_per_s" and not k.startswith("ms_")}
             for ln in (d / "draft/train_log.jsonl").open()] for d in (dst, out)]
    assert logs[0] == logs[1]


def test_draft_stage_bad_inputs(ref, tmp_path):
    out, _ = ref
    dst = with_tokenizer(out, tmp_path)
    with pytest.raises(SystemExit, match="run the target stage first"):
        run(dst, "--stages", "draft")
    shutil.copytree(out / "target", dst / "target")
    (dst / "draft_train").mkdir()
    (dst / "draft_train" / "stage_fingerprint.json").write_text('{"seed": 7}')
    with pytest.raises(SystemExit, match="--force"):  # leftovers of another config / target
        run(dst, "--stages", "draft")
    assert run(dst, "--stages", "draft", "--force")["draft"] is not None


def test_bench_stage_measures_the_built_pair(ref):
    out, summary = ref
    records = json.loads((out / "bench" / "results.json").read_text())
    methods = {(r["method"], r["budget"]) for r in records}
    assert {("autoregressive", None), ("chain", None), ("tev", 4), ("predraw", 4), ("sequential", 4)} <= methods
    assert all(r["tau"] >= 1.0 for r in records if r["rounds"])
    assert set(summary["bench"]["tau"]) == {
        f"{m}{'' if b is None else '@' + str(b)}_T0" for m, b in methods
    }
    assert (out / "bench" / "stage.json").exists() and (out / "bench" / "tau_hist.png").stat().st_size > 0


def test_quick_build_is_never_shipped(ref, monkeypatch, tmp_path):
    out, _ = ref
    monkeypatch.setattr(btc, "ASSETS", tmp_path / "assets" / "tiny-code")
    with pytest.raises(SystemExit, match="--quick"):
        run(out, "--stages", "ship")
    assert not (tmp_path / "assets").exists()
    # nor by a full-size command pointed at the quick folder
    with pytest.raises(SystemExit, match="argument --out: .*another config"):
        btc.main(["--threads", "1", "--out", str(out), "--stages", "ship"])
    with pytest.raises(SystemExit, match="argument --out: .*another config"):
        btc.main(["--threads", "1", "--out", str(out), "--stages", "exittrain"])
    assert not (tmp_path / "assets").exists()


def test_model_card_is_filled_from_the_measurements(ref):
    out, summary = ref
    card = btc.model_card(out)
    assert "| tev | 4 | 0 |" in card and "PSF" in card
    assert f"{summary['target']['params']:,}" in card
    assert "`draft-base/model.safetensors`" in card and "ExitTrain" in card  # both drafters
    assert f"{summary['exittrain']['heldout_block_len']['T0']:.3f} at T = 0" in card


@pytest.mark.parametrize("stage, needs", [("target", "tokenizer"), ("draft", "target"), ("exittrain", "draft"),
                                         ("bench", "exittrain")])
def test_stage_out_of_order_exits_2(stage, needs, tmp_path):
    """A stage run before the one it reads is a bad --stages value: status 2 and one line, as the
    docs say for bad arguments (in-process: SystemExit with code 2 and the message)."""
    with pytest.raises(SystemExit, match=f"run the {needs} stage first") as e:
        run(tmp_path / "o", "--stages", stage)
    assert e.value.code == 2
    p = subprocess.run([sys.executable, str(SCRIPT), *QUICK, "--out", str(tmp_path / "p"), "--stages", stage],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (f"build_tiny_code.py: error: argument --stages: '{stage}' needs "
                                f"{tmp_path / 'p' / needs}; run the {needs} stage first"), p.stderr


# ---------------------------------------------------------------------------------------------
# stage `exittrain` (rollouts + sglang_tev.train with the exit loss) and what ships

def test_exittrain_stage_fine_tunes_the_draft_stage_drafter(ref):
    from sglang_tev.draft.dflash import DFlashDraftModel
    from sglang_tev.hf.runtime import SpeculativeGenerator
    out, summary = ref
    E = btc.QUICK_EXIT
    assert not (out / "exittrain_train").exists()
    metrics = json.loads((out / "exittrain" / "metrics.json").read_text())
    assert {k: v for k, v in metrics.items() if k not in ("heldout", "exittrain")} == summary["exittrain"]
    assert metrics["exittrain"] == json.loads(json.dumps(btc.dataclasses.asdict(E)))
    assert summary["exittrain"]["rollouts"] == E.prompts and summary["exittrain"]["steps"] == E.steps
    # the trainer ran the stage's loss on the stage's rollouts
    cfg = (out / "exittrain" / "config.yaml").read_text()
    for want in (f"mode: {E.exit_mode}", f"lambda: {E.exit_lambda}", f"temperature: {E.exit_temperature}",
                 "distill_weight: 0.0", str(out / "draft")):
        assert want in cfg, want
    log = [json.loads(ln) for ln in (out / "exittrain" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, E.steps + 1))
    assert any(r["loss_exit"] > 0 for r in log)  # the exit term was on (0 where no tree reached the target)
    prompts = [json.loads(ln) for ln in (out / "exittrain" / "train_prompts.jsonl").read_text().splitlines()]
    split = json.loads((out / "tokenizer" / "split.json").read_text())
    assert len(prompts) == E.prompts and {r["id"].rsplit(":", 1)[0] for r in prompts} <= set(split["train"])
    # bf16 as shipped, changed by training, same architecture; before/after measured on held-out data
    base = DFlashDraftModel.from_pretrained(out / "draft")
    tuned = DFlashDraftModel.from_pretrained(out / "exittrain")
    assert tuned.fc.weight.dtype == torch.bfloat16 and tuned.config.to_dict() == base.config.to_dict()
    assert any(not torch.equal(a, b) for a, b in zip(base.state_dict().values(), tuned.state_dict().values()))
    for part in (summary["exittrain"], summary["exittrain"]["before"]):
        assert set(part["heldout_block_len"]) == {"T0", "T1"}
        assert all(1.0 <= v <= 1 + E.budget for v in part["heldout_block_len"].values())
    # the bench stage measured this drafter, and it stays lossless
    assert f"--draft {out / 'exittrain'}" in json.loads((out / "bench" / "meta.json").read_text())["command"]
    gen = SpeculativeGenerator.from_pretrained(out / "target", out / "exittrain", device="cpu")
    want = gen.generate("import os\n", method="autoregressive", max_new_tokens=16, ignore_eos=True).token_ids
    assert gen.generate("import os\n", method="tev", budget=8, max_new_tokens=16, ignore_eos=True).token_ids == want


def test_exittrain_stage_resumes_bit_identically(ref, tmp_path):
    out, summary = ref
    dst = with_tokenizer(out, tmp_path)
    for stage in ("target", "draft"):
        shutil.copytree(out / stage, dst / stage)
    first = run(dst, "--stages", "exittrain", "--max-steps", "1")
    assert first["exittrain"] is None and not (dst / "exittrain").exists()
    assert (dst / "exittrain_train" / "rollouts.jsonl").exists()
    # the stage pins one thread, so another --threads resumes it (and does not change the bytes)
    second = btc.main(["--quick", "--threads", "2", "--max-files", "12", "--out", str(dst), "--stages", "exittrain"])
    torch.set_num_threads(1)
    assert second["exittrain"] == summary["exittrain"] | {"wall_s": second["exittrain"]["wall_s"]}
    assert (dst / "exittrain/model.safetensors").read_bytes() == (out / "exittrain/model.safetensors").read_bytes()


def test_exittrain_stage_refuses_leftovers_of_another_drafter(ref, tmp_path):
    out, _ = ref
    dst = with_tokenizer(out, tmp_path)
    for stage in ("target", "draft"):
        shutil.copytree(out / stage, dst / stage)
    (dst / "exittrain_train").mkdir()
    (dst / "exittrain_train" / "stage_fingerprint.json").write_text('{"draft_sha256": "0"}')
    with pytest.raises(SystemExit, match="--force"):
        run(dst, "--stages", "exittrain")
    assert not (dst / "exittrain").exists()


def test_ship_copies_the_exittrain_drafter_as_draft_and_the_base_as_draft_base(ref, tmp_path, monkeypatch):
    out, _ = ref
    full = tmp_path / "full"
    shutil.copytree(out, full)
    monkeypatch.setattr(btc, "ASSETS", tmp_path / "assets" / "tiny-code")
    monkeypatch.setattr(btc, "bench_config_for", lambda cfg: btc.FULL_BENCH)  # ship the quick pair here
    btc.build_ship(btc.argparse.Namespace(seed=0), btc.FULL, full)
    shipped = tmp_path / "assets" / "tiny-code"
    for part, stage in (("draft", "exittrain"), ("draft-base", "draft"), ("target", "target")):
        assert (shipped / part / "model.safetensors").read_bytes() == (full / stage / "model.safetensors").read_bytes()
    assert "exittrain" in json.loads((shipped / "draft" / "metrics.json").read_text())
    assert (shipped / "README.md").read_text() == btc.model_card(full)


def test_from_assets_adopts_the_packaged_pair(tmp_path, monkeypatch, capsys):
    """Full-size tokenizer stage (~10 s) and --from-assets in one command: target and draft stages
    hold the packaged files, and the stage loop accepts them as complete seed-0 stages."""
    out = tmp_path / "o"
    btc.main(["--threads", "1", "--out", str(out), "--stages", "tokenizer"])
    assets = btc.ASSETS
    if btc.sha256_file(out / "tokenizer" / "tokenizer.json") != btc.sha256_file(assets / "target" / "tokenizer.json"):
        pytest.skip("this interpreter's stdlib gives another tokenizer than the packaged one")
    base = assets / "draft-base" if (assets / "draft-base").is_dir() else assets / "draft"
    capsys.readouterr()
    res = btc.main(["--threads", "1", "--out", str(out), "--stages", "tokenizer,target,draft", "--from-assets"])
    printed = capsys.readouterr().out
    assert "target: adopted from" in printed and "draft: adopted from" in printed
    for stage, src in (("target", assets / "target"), ("draft", base)):
        assert (out / stage / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
        assert f"\n{stage:<10} skipped (complete)" in printed  # fingerprints equal a seed-0 build's
        assert res[stage]["adopted_from"] == str(src)
    assert "exittrain" not in btc.stage_record(out, "draft")["summary"]
    mtime = (out / "draft" / "stage.json").stat().st_mtime_ns
    btc.main(["--threads", "1", "--out", str(out), "--stages", "draft", "--from-assets"])  # idempotent
    assert (out / "draft" / "stage.json").stat().st_mtime_ns == mtime
    # refusals: one line naming the argument, nothing written
    for argv, msg in ((["--seed", "1"], "seed 0"), (["--quick"], "--quick"),
                      (["--stages", "draft", "--force"], "--force")):
        with pytest.raises(SystemExit) as e:
            btc.main(["--threads", "1", "--out", str(out), "--from-assets", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "argument --from-assets" in err and msg in err, err
    assert (out / "draft" / "stage.json").stat().st_mtime_ns == mtime
    with pytest.raises(SystemExit, match="argument --from-assets: needs"):
        btc.main(["--threads", "1", "--out", str(tmp_path / "none"), "--stages", "exittrain", "--from-assets"])
    assert not (tmp_path / "none" / "target").exists()
    # a stage that is not the packaged one is not silently used
    other = tmp_path / "other"
    shutil.copytree(out, other)
    (other / "draft" / "model.safetensors").write_bytes(b"not the packaged drafter")
    with pytest.raises(SystemExit, match="argument --from-assets: .*is not the packaged"):
        btc.main(["--threads", "1", "--out", str(other), "--stages", "draft", "--from-assets"])
    # a package whose only drafter is an ExitTrain one cannot stand in for the draft stage
    fake = tmp_path / "pkg" / "tiny-code"
    shutil.copytree(assets / "target", fake / "target")
    shutil.copytree(base, fake / "draft")
    m = json.loads((fake / "draft" / "metrics.json").read_text())
    (fake / "draft" / "metrics.json").write_text(json.dumps({**m, "exittrain": {}}))
    monkeypatch.setattr(btc, "ASSETS", fake)
    shutil.rmtree(out / "draft")
    with pytest.raises(SystemExit, match="ExitTrain drafter"):
        btc.main(["--threads", "1", "--out", str(out), "--stages", "draft", "--from-assets"])
    assert not (out / "draft").exists()


def test_a_stage_whose_input_stage_is_gone_is_one_line(ref, tmp_path):
    out, _ = ref
    dst = tmp_path / "o"
    shutil.copytree(out, dst)
    shutil.rmtree(dst / "exittrain")
    with pytest.raises(SystemExit, match="argument --stages: 'bench' .* missing"):
        run(dst, "--stages", "bench")
