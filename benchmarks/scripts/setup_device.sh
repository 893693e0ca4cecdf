# source me on the device: installs the wheels carried in .whl (no network there) and sets PYTHONPATH
export PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/site python3 -c "import pytest, fla, fastapi, uvicorn, httpx, prometheus_client, soundfile, python_multipart" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
