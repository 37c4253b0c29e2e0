"""One test file per tool-call dialect of server/parsing/formats/."""
