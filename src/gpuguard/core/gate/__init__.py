"""The restart gate (pure): who may ask for it, what crosses its socket, and its loop.

``proto`` the socket's wire format (one request line in, framed lines and a verdict out);
``auth`` who may ask the gate server for what, from who the kernel says the caller is; ``run``
the gate's loop that frees a unit's GPUs of stale holders and waits until they are idle.
"""
