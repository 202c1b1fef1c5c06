"""Training the papers' models: the loop (``loop``) and checkpoints that lose nothing (``checkpoint``)."""
