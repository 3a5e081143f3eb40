#!/usr/bin/env bash
# Run the compatibility-critical tests on the OLDEST transformers release pyproject allows (README's test command
# covers the newest one the registry resolves). CI runs both; run this locally before changing anything that touches
# transformers (hf_dsinfer/hf_compat.py is the boundary).
#
#   scripts/test_oldest_transformers.sh [pytest args...]
#
# It builds .venv-oldest beside the project (torch from the same wheel as README's install, the project's dev extra,
# then transformers pinned to the oldest supported minor release) and runs the modules below with pytest -n auto.
set -euo pipefail
cd "$(dirname "$0")/.."

OLDEST="5.17.*"  # keep in step with pyproject's lower bound and hf_compat.OLDEST_TESTED
MODULES=(
    tests/test_hf_contracts.py tests/test_hf_boundary.py tests/test_injected_cache.py tests/test_prompt_lookup.py
    tests/test_compiled_verify.py
    tests/test_fidelity.py tests/test_generation.py tests/test_generation_sampling.py tests/test_generic_path.py
    tests/test_hybrid.py tests/test_hybrid_fast.py tests/test_hybrid_adapters.py tests/test_trl.py
    tests/test_quant.py tests/test_quant_float_zero.py tests/test_quant_gptq.py tests/test_readme.py
    tests/test_integration.py
    tests/test_serving_batch_processors.py tests/test_serving_sampling.py tests/test_generation_scores.py
    tests/test_hybrid_shared_prefill.py
)

if [ ! -x .venv-oldest/bin/python ]; then
    python3 -m venv .venv-oldest
fi
# shellcheck disable=SC1091
. .venv-oldest/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]" "transformers==${OLDEST}"
python -c "import transformers; print('oldest-transformers run on transformers', transformers.__version__)"
pytest -n auto "${MODULES[@]}" "$@"
