// The tokens of a reply that wrote tool calls: the `<tool_call>…</tool_call>` blocks became the
// tool-call cards (the API gives content null for them), so the token view leaves their tokens out.
import type { TokenView } from "../../core/openai";

const OPEN = "<tool_call>";
const CLOSE = "</tool_call>";

/** Character ranges [start, end) of the tool-call blocks in `text`; an unclosed last block runs to
 * the end when `openEnded` (it is still streaming, and the server holds it back until it closes). */
export function toolCallSpans(text: string, openEnded: boolean): [number, number][] {
  const spans: [number, number][] = [];
  let from = 0;
  for (;;) {
    const start = text.indexOf(OPEN, from);
    if (start < 0) break;
    const close = text.indexOf(CLOSE, start + OPEN.length);
    if (close < 0) {
      if (openEnded) spans.push([start, text.length]);
      break;
    }
    // the whitespace after a block separates it from the next one: it goes with it
    let end = close + CLOSE.length;
    while (end < text.length && /\s/.test(text[end]!)) end++;
    spans.push([start, end]);
    from = end;
  }
  return spans;
}

/** The indices of the tokens to show: those not inside a tool-call block. */
export function tokensOutsideToolCalls(tokens: readonly Pick<TokenView, "text">[], openEnded: boolean): number[] {
  const text = tokens.map((t) => t.text).join("");
  const spans = toolCallSpans(text, openEnded);
  const keep: number[] = [];
  let pos = 0;
  tokens.forEach((t, i) => {
    const start = pos;
    const end = pos + t.text.length;
    pos = end;
    // a token that overlaps a block at all is part of the call's markup
    const inside = spans.some(([a, b]) => (start === end ? start >= a && start < b : start < b && end > a));
    if (!inside) keep.push(i);
  });
  return keep;
}
