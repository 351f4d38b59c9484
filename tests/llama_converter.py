"""llama.cpp's Hugging Face -> GGUF converter, for tests/test_gguf_llama.py: `python tests/llama_converter.py DIR`
puts convert_hf_to_gguf.py (with its conversion package and the gguf-py it imports) in DIR, from the sdist of
llama-cpp-python (the release the benchmark's peer pins), unless DIR holds that release already. tox's hf env
runs it."""

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

RELEASE = "0.3.36"  # llama-cpp-python's, vendoring llama.cpp's converter of that day
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
_MARK = "release.txt"  # written last: a folder without it (or of another release) is fetched again


def fetch(folder: Path) -> Path:
    if (folder / _MARK).is_file() and (folder / _MARK).read_text() == RELEASE:
        return folder / "convert_hf_to_gguf.py"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        # (the sdist only: --no-binary of this package, not of the build tools pip's metadata step installs)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", "llama-cpp-python", f"llama-cpp-python=={RELEASE}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefix, unpacked = f"llama_cpp_python-{RELEASE}/vendor/llama.cpp/", Path(tmp, "llama.cpp")
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                inside = member.name[len(prefix):] if member.name.startswith(prefix) else ""
                if member.isfile() and inside.startswith(_KEEP):
                    member.name = inside
                    tar.extract(member, unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        if not (unpacked / "convert_hf_to_gguf.py").is_file():
            raise SystemExit(f"{sdist.name} holds no vendor/llama.cpp/convert_hf_to_gguf.py: a new layout?")
        (unpacked / _MARK).write_text(RELEASE)
        shutil.rmtree(folder, ignore_errors=True)
        unpacked.rename(folder)
    return folder / "convert_hf_to_gguf.py"


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1])))
