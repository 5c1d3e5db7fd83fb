"""vLLM's LoRARequest (tests only): an adapter folder named for the engine, with the integer id it is cached under."""

from dataclasses import dataclass


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
