"""The main process's side of serving: the tokenizer manager (request state, streaming, the
``Engine``'s and the HTTP server's one entry), input processing (validation, chat templates,
tokenization), the ``/generate`` body and the IPC to the scheduler and detokenizer. It imports no
scheduler or model code; messages cross to the other processes as ``srt.managers.io_struct``."""
