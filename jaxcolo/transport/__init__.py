"""Controller <-> worker transport: authenticated framed channels and the
versioned hello handshake.  Executors (jaxcolo.colocated) build on this."""
