"""The cache policies of the models whose prefix needs more than full blocks, simulated on the same agent requests as
the anchors' (vLLM's, llama.cpp's): hybrid models' state snapshots (`hybrid`, `hybrid_engine` through the real
engine, `hybrid_report` the table of both) and sliding-window models' retained windows (`sliding_window`)."""
