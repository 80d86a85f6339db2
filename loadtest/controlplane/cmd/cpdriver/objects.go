package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// objectsResult is what object-compare prints.
type objectsResult struct {
	// Equal is true when every object decoded from both paths is
	// semantically equal, as a list item and as a GET.
	Equal bool `json:"equal"`
	// Items is how many objects the direct LIST held.
	Items int `json:"items"`
	// ProtobufVia and ProtobufDirect say whether the answers were protobuf
	// (the k8s\0 magic), the LIST and every GET alike.
	ProtobufVia    bool     `json:"protobuf_via"`
	ProtobufDirect bool     `json:"protobuf_direct"`
	Diffs          []string `json:"diffs"`
}

// objectCompare reads a namespace's objects with resourceVersion=0 (a read
// Bulwark answers from its cache) through --via and straight from the
// apiserver through --direct, as a LIST and as one GET per object, decodes
// them with client-go's own decoders (protobuf when --accept prefers it) and
// compares every object with apimachinery's semantic equality: all of
// metadata (uid, timestamps, owners, managedFields) and the content.
func objectCompare(args []string) (any, error) {
	fs := newFlagSet("object-compare")
	via := fs.String("via", "", "kubeconfig through Bulwark")
	direct := fs.String("direct", "", "kubeconfig straight to an apiserver")
	resource := fs.String("resource", "secrets", "secrets or endpointslices")
	namespace := fs.String("namespace", "default", "namespace to read")
	accept := fs.String("accept", "", "rest.Config.AcceptContentTypes for both clients")
	timeout := fs.Duration("timeout", 60*time.Second, "overall time limit")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if *via == "" || *direct == "" {
		return nil, errors.New("--via and --direct are required")
	}
	viaClient, err := clientFor(*via, *accept, "")
	if err != nil {
		return nil, err
	}
	directClient, err := clientFor(*direct, *accept, "")
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()

	viaList, viaProto, err := read(ctx, restFor(viaClient, *resource), *resource, *namespace, "")
	if err != nil {
		return nil, fmt.Errorf("via LIST: %w", err)
	}
	directList, directProto, err := read(ctx, restFor(directClient, *resource), *resource, *namespace, "")
	if err != nil {
		return nil, fmt.Errorf("direct LIST: %w", err)
	}
	viaItems, err := byName(viaList)
	if err != nil {
		return nil, err
	}
	directItems, err := byName(directList)
	if err != nil {
		return nil, err
	}
	result := objectsResult{Items: len(directItems), ProtobufVia: viaProto, ProtobufDirect: directProto}
	for name, d := range directItems {
		v, ok := viaItems[name]
		if !ok {
			result.Diffs = append(result.Diffs, name+": missing via Bulwark")
			continue
		}
		if !apiequality.Semantic.DeepEqual(v, d) {
			result.Diffs = append(result.Diffs, name+": LIST items differ")
		}
		viaObj, p1, err := read(ctx, restFor(viaClient, *resource), *resource, *namespace, name)
		if err != nil {
			return nil, fmt.Errorf("via GET %s: %w", name, err)
		}
		directObj, p2, err := read(ctx, restFor(directClient, *resource), *resource, *namespace, name)
		if err != nil {
			return nil, fmt.Errorf("direct GET %s: %w", name, err)
		}
		result.ProtobufVia = result.ProtobufVia && p1
		result.ProtobufDirect = result.ProtobufDirect && p2
		if !apiequality.Semantic.DeepEqual(viaObj, directObj) {
			result.Diffs = append(result.Diffs, name+": GET answers differ")
		}
	}
	for name := range viaItems {
		if _, ok := directItems[name]; !ok {
			result.Diffs = append(result.Diffs, name+": missing straight from the apiserver")
		}
	}
	sort.Strings(result.Diffs)
	result.Equal = len(result.Diffs) == 0
	return result, nil
}

// restFor is the REST client of the resource's API group.
func restFor(client kubernetes.Interface, resource string) rest.Interface {
	if resource == "endpointslices" {
		return client.DiscoveryV1().RESTClient()
	}
	return client.CoreV1().RESTClient()
}

// read GETs one object (name) or LISTs the namespace at resourceVersion=0,
// decodes the answer with the client's decoder, and says whether it was
// protobuf.
func read(ctx context.Context, client rest.Interface, resource, namespace, name string) (runtime.Object, bool, error) {
	request := client.Get().Namespace(namespace).Resource(resource).Param("resourceVersion", "0")
	if name != "" {
		request = request.Name(name)
	}
	result := request.Do(ctx)
	raw, err := result.Raw()
	if err != nil {
		return nil, false, err
	}
	obj, err := result.Get()
	if err != nil {
		return nil, false, err
	}
	return obj, bytes.HasPrefix(raw, []byte("k8s\x00")), nil
}

// byName indexes a list's items by name.
func byName(list runtime.Object) (map[string]runtime.Object, error) {
	items, err := meta.ExtractList(list)
	if err != nil {
		return nil, err
	}
	out := map[string]runtime.Object{}
	for _, item := range items {
		m, err := meta.Accessor(item)
		if err != nil {
			return nil, err
		}
		out[m.GetName()] = item
	}
	return out, nil
}
