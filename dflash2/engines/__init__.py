"""Serving engines as peers: vLLM in its own virtual environment (`vllm.py` starts `vllm_worker.py`
with that venv's interpreter; dflash2 never imports vllm)."""
