"""An FTP server on loopback (pyftpdlib), one user with a password: the second store, beside
moto's S3, that run directories are tested on. ``ftp://`` reaches sparkcnn through fsspec."""

from __future__ import annotations

import contextlib
import threading


@contextlib.contextmanager
def ftp_server(root: str, user: str = "sparkcnn", password: str = "s3cret"):
    """Yield the ``ftp://user:password@127.0.0.1:port`` URL of a server serving ``root``."""
    from pyftpdlib.authorizers import DummyAuthorizer
    from pyftpdlib.handlers import FTPHandler
    from pyftpdlib.servers import ThreadedFTPServer

    auth = DummyAuthorizer()
    auth.add_user(user, password, root, perm="elradfmwMT")  # read, list, write, delete, rename, mkdir

    class Handler(FTPHandler):
        authorizer = auth
        passive_ports = None
        masquerade_address = None

    server = ThreadedFTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"timeout": 0.2}, daemon=True)
    thread.start()
    try:
        yield f"ftp://{user}:{password}@127.0.0.1:{server.address[1]}"
    finally:
        server.close_all()
        thread.join(10)
