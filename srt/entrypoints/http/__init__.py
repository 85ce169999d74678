"""The HTTP layer: one FastAPI app built by `app.create_app` from three routers.

    app.py             create_app(tm): lifespan (starts/stops the TokenizerManager), API-key
                       middleware, error handlers, the routers below
    auth.py            --api-key / --admin-api-key (which route takes which key), key redaction
    openapi.py         /openapi.json completed: request bodies, error answers, SSE, links
    deps.py            ServerContext (the TokenizerManager and the OpenAI serving objects) on
                       ``app.state``, reached by routes through the ``Ctx`` dependency
    openai_routes.py   /v1/completions, /v1/chat/completions, /v1/models
    native_routes.py   /generate, /health, /health_generate, /get_model_info, /get_server_info
                       (also /model_info, /server_info), /get_load, /version, /tokenize, /detokenize
    admin_routes.py    /flush_cache, /abort_request, /metrics, /start_profile, /stop_profile,
                       /update_weights_from_disk
    web_routes.py      the built-in web page: GET / and /web/<file> (web/: chat and dashboard),
                       GET /dashboard_state (dashboard.py)
    serving.py         body parsing, disconnect-aware execution (``serve``), the streaming response
    sse.py             the one server-sent-events helper

The process around it (uvicorn, signals, child death) is `srt.entrypoints.http_server`.
This package imports nothing at package level (the OpenAI serving modules import ``sse``).
"""
