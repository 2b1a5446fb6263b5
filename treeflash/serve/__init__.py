"""OpenAI-compatible HTTP server (`treeflash serve`) and terminal chat (`treeflash chat`)."""
