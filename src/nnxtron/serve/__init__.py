"""``nnxtron serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the
continuous-batching engine (``infer.engine``).

- ``protocol``: request models, error bodies, stop strings, log-probabilities, SSE chunks;
- ``metrics``: Prometheus text-format counters, gauges and latency histograms;
- ``app``: the FastAPI application (``create_app(ServeState(...))``);
- ``server``: loading a run / HF directory and running uvicorn (``serve``).
"""
