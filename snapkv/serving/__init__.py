"""snapkv in the tools people use: the OpenAI-compatible HTTP API (`snapkv serve --http`).

    chat_request  an OpenAI chat completion body -> ChatRequest (document, question, decoding), or a RequestError
    chat_service  a ChatRequest answered by a loaded model through snapkv.session, as `snapkv ask` answers
    openai_app    the ASGI app: routes, API key, the queue, streaming, clients that leave
"""
