# source me on the device: installs the carried wheels (.whl) and sets PYTHONPATH
export PYTHONUNBUFFERED=1
python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/pytest-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl
python3 -c "import fla" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site3 .whl/fla_core-*.whl .whl/einops-*.whl
python3 -c "import fastapi, uvicorn, httpx, prometheus_client, soundfile, multipart" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl --target /tmp/site2 fastapi uvicorn httpx prometheus_client soundfile python-multipart 2>&1 | grep -v numpy | tail -1
export PYTHONPATH=/tmp/site:$PWD:/tmp/site2:/tmp/site3
