"""Start-up checks of the TLS flags (--ssl-keyfile, --ssl-certfile): both or neither, each a
readable file, the pair loadable by Python's ssl module (so a wrong file fails the launch with a
ConfigError naming the flag, not the first connection)."""

from __future__ import annotations

import os
import ssl

from srt.utils.errors import ConfigError


def check_tls_files(keyfile: str | None, certfile: str | None) -> None:
    if keyfile is None and certfile is None:
        return
    if keyfile is None or certfile is None:
        missing = "--ssl-keyfile" if keyfile is None else "--ssl-certfile"
        raise ConfigError(f"HTTPS needs both --ssl-keyfile and --ssl-certfile; {missing} is missing.")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {path!r} is not a file.")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"--ssl-certfile / --ssl-keyfile could not be loaded as a PEM pair: {e}") from e
