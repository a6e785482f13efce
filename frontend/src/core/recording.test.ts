import { describe, expect, it } from "vitest";
import { parseRecording, recordingOwner, RecordingFormatError } from "./recording";

const header = JSON.stringify({ type: "header", version: 1, created: "2025-01-01T00:00:00Z", snapshot: { type: "snapshot", seq: 0, ts: 0, step: 0, config: {}, requests: [], blocks: [] } });

describe("parseRecording", () => {
  it("reads header, events and footer, skipping blank lines", () => {
    const text = [header, "", JSON.stringify({ type: "metrics", seq: 1 }), JSON.stringify({ type: "footer", snapshot: { type: "snapshot" } }), ""].join("\n");
    const r = parseRecording(text, "x");
    expect(r.events).toHaveLength(1);
    expect(r.footer).not.toBeNull();
    expect(r.name).toBe("x");
  });

  it("names the bad line", () => {
    const bad = (text: string) => {
      try {
        parseRecording(text);
      } catch (err) {
        expect(err).toBeInstanceOf(RecordingFormatError);
        return (err as RecordingFormatError).message;
      }
      throw new Error("no error");
    };
    expect(bad("")).toMatch(/line 1: empty/);
    expect(bad(JSON.stringify({ type: "metrics" }))).toMatch(/line 1: not a recording header/);
    expect(bad([header, "{nope"].join("\n"))).toMatch(/line 2: not JSON/);
    expect(bad([header, JSON.stringify({ type: "what" })].join("\n"))).toMatch(/line 2: unknown event type/);
    expect(bad([header, JSON.stringify({ type: "footer", snapshot: {} }), JSON.stringify({ type: "metrics" })].join("\n"))).toMatch(/line 3: content after the footer/);
  });
});

describe("recordingOwner", () => {
  it("says whose recording it is", () => {
    expect(recordingOwner({ mine: true, server: "127.0.0.1-8000" })).toBe("this server");
    expect(recordingOwner({ mine: false, server: "127.0.0.1-8001" })).toBe("from 127.0.0.1-8001");
    expect(recordingOwner({ server: "upload" })).toBe("uploaded");
    expect(recordingOwner({})).toBe("unknown server");
  });
});
