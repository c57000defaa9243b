"""The serving engine as part of the pipeline: servers the stages start and stop (server.py), vLLM's command
line, installation and limits (vllm.py)."""
