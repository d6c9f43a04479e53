"""The CPU path: the executor (a batch in chunks over worker threads), JPEG decode of the crop's window
with nvImageCodec's CPU backend, the geometric ops and the post ops on uint8 pixels with torch."""
