"""Next-token quality of a quantized KV cache against fp16 KV (`kvtax quality`)."""
