import { describe, expect, it } from "vitest";
import { config } from "../../test/events";
import { changedFields, formOf } from "./SettingsPanel";

describe("engine settings form", () => {
  it("sends only what changed, the KV cache dtype included", () => {
    const current = { ...config(), kv_cache_dtype: "float32" };
    const form = formOf(current);
    expect(form.kv_cache_dtype).toBe("float32");
    expect(changedFields(current, form)).toEqual({});
    expect(changedFields(current, { ...form, kv_cache_dtype: "float16", num_blocks: form.num_blocks + 1 }))
      .toEqual({ kv_cache_dtype: "float16", num_blocks: form.num_blocks + 1 });
  });

  it("shows an 8-bit pool as itself, not as the model's dtype", () => {
    for (const dtype of ["int8", "fp8_e4m3"]) {
      const current = { ...config(), kv_cache_dtype: dtype };
      expect(formOf(current).kv_cache_dtype).toBe(dtype);
      expect(changedFields(current, formOf(current))).toEqual({});
    }
  });

  it("reads a server from before the option as a pool in the model's dtype, not as a change", () => {
    const old = { ...config(), dtype: "bfloat16" };
    delete (old as { kv_cache_dtype?: string }).kv_cache_dtype;
    expect(formOf(old).kv_cache_dtype).toBe("bfloat16");
    expect(changedFields(old, formOf(old))).toEqual({});
  });
});
